"""The node agent's engines: the PyTorch engine (a Llama-family model over a paged KV pool with a
radix prefix cache, driven by a continuous-batching scheduler) and the emulated one
(agents/engine/emulated.py); no Django here. Importing the package loads no torch: the names
that need it (Engine, the loader's) import it when first used, so an agent that runs only
emulated engines never loads it. The tokenizer front lives torch-free in ``pdd.tokenizer``."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from agents.engine.config import EngineConfig, ModelConfig
from agents.engine.errors import EngineFull, PrefixMissing
from agents.engine.kv_pool import KVPool, OutOfBlocks, PagedKVPool, read_kv_header
from agents.engine.outputs import (
    EngineStats,
    GenerateResult,
    ImportResult,
    PrefillResult,
    TokenLogprob,
    TokenOutput,
)
from agents.engine.radix_cache import MatchResult, RadixCache
from agents.engine.request import FinishReason, SamplingParams
from pdd.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, apply_chat_template

if TYPE_CHECKING:
    from agents.engine.engine import Engine
    from agents.engine.loader import (
        BATON_TINY,
        LoadedModel,
        build_baton_tiny,
        load_hf_checkpoint,
        load_model,
    )

# name -> module, imported (with torch) on first use
_LAZY = {
    "Engine": "agents.engine.engine",
    "BATON_TINY": "agents.engine.loader",
    "LoadedModel": "agents.engine.loader",
    "build_baton_tiny": "agents.engine.loader",
    "load_hf_checkpoint": "agents.engine.loader",
    "load_model": "agents.engine.loader",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'agents.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "BATON_TINY",
    "ByteTokenizer",
    "Engine",
    "EngineConfig",
    "EngineFull",
    "EngineStats",
    "FinishReason",
    "GenerateResult",
    "HFTokenizer",
    "ImportResult",
    "KVPool",
    "LoadedModel",
    "MatchResult",
    "ModelConfig",
    "OutOfBlocks",
    "PagedKVPool",
    "PrefillResult",
    "PrefixMissing",
    "RadixCache",
    "SamplingParams",
    "TokenLogprob",
    "TokenOutput",
    "Tokenizer",
    "apply_chat_template",
    "build_baton_tiny",
    "load_hf_checkpoint",
    "load_model",
    "read_kv_header",
]
