"""PyTorch engine of Baton's node agent: a Llama-family model over a paged KV pool with a radix
prefix cache, driven by a continuous-batching scheduler; no Django here. Importing it loads
torch; the tokenizer front it re-exports lives torch-free in ``pdd.tokenizer``."""

from agents.engine.config import EngineConfig, ModelConfig
from agents.engine.engine import Engine
from agents.engine.errors import EngineFull, PrefixMissing
from agents.engine.kv_pool import KVPool, OutOfBlocks, PagedKVPool, read_kv_header
from agents.engine.loader import (
    BATON_TINY,
    LoadedModel,
    build_baton_tiny,
    load_hf_checkpoint,
    load_model,
)
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
