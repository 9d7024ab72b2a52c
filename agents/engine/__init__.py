"""PyTorch engine of Baton's node agent: a Llama-family model over a paged KV pool with a radix
prefix cache, driven by a continuous-batching scheduler; no Django here."""

import importlib
from typing import Any

# Exports resolve on first use, so `agents.engine.tokenizer` (used by the torch-free gateway)
# can be imported without loading torch through this package.
_EXPORTS = {
    "BATON_TINY": "agents.engine.loader",
    "ByteTokenizer": "agents.engine.tokenizer",
    "Engine": "agents.engine.engine",
    "EngineConfig": "agents.engine.config",
    "EngineFull": "agents.engine.errors",
    "EngineStats": "agents.engine.outputs",
    "FinishReason": "agents.engine.request",
    "GenerateResult": "agents.engine.outputs",
    "HFTokenizer": "agents.engine.tokenizer",
    "ImportResult": "agents.engine.outputs",
    "KVPool": "agents.engine.kv_pool",
    "LoadedModel": "agents.engine.loader",
    "MatchResult": "agents.engine.radix_cache",
    "ModelConfig": "agents.engine.config",
    "OutOfBlocks": "agents.engine.kv_pool",
    "PagedKVPool": "agents.engine.kv_pool",
    "PrefillResult": "agents.engine.outputs",
    "PrefixMissing": "agents.engine.errors",
    "RadixCache": "agents.engine.radix_cache",
    "SamplingParams": "agents.engine.request",
    "TokenLogprob": "agents.engine.outputs",
    "TokenOutput": "agents.engine.outputs",
    "Tokenizer": "agents.engine.tokenizer",
    "apply_chat_template": "agents.engine.tokenizer",
    "build_baton_tiny": "agents.engine.loader",
    "load_hf_checkpoint": "agents.engine.loader",
    "load_model": "agents.engine.loader",
    "read_kv_header": "agents.engine.kv_pool",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'agents.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


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
