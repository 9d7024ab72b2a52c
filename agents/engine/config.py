"""Model and engine configuration for the node agent's PyTorch engine."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# The dtype names an engine accepts (EngineConfig.dtype), in that order. torch is imported only
# where a torch dtype or device is made (parse_dtype, parse_device), so an agent that runs only
# emulated engines never loads it.
DTYPE_NAMES: tuple[str, ...] = ("float32", "bfloat16", "float16")
_DEVICE = re.compile(r"(cpu|cuda)(:\d+)?")


def _torch_dtypes() -> dict[str, Any]:
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_dtype_name(name: str) -> str:
    """`name` if it is one of DTYPE_NAMES; ValueError otherwise (torch-free)."""
    if not isinstance(name, str) or name not in DTYPE_NAMES:
        raise ValueError(f"unsupported dtype {name!r}; use one of {sorted(DTYPE_NAMES)}")
    return name


def check_device_name(name: str) -> str:
    """`name` if it is cpu, cuda or cuda:N (torch-free; no check that it exists)."""
    if not isinstance(name, str) or not _DEVICE.fullmatch(name):
        raise ValueError(f"EngineConfig.device must be cpu, cuda or cuda:N, got {name!r}")
    return name


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """Return the torch dtype for "float32" / "bfloat16" / "float16" (or a dtype itself)."""
    import torch

    dtypes = _torch_dtypes()
    if isinstance(name, torch.dtype):
        if name not in dtypes.values():
            raise ValueError(f"unsupported dtype {name}; use one of {sorted(dtypes)}")
        return name
    return dtypes[check_dtype_name(name)]


def parse_device(name: str) -> torch.device:
    """Return the torch device for "cpu", "cuda" or "cuda:N" (no check that it exists)."""
    import torch

    return torch.device(check_device_name(name))


@dataclass(slots=True)
class ModelConfig:
    """Shape of a Llama-family decoder (Llama, Qwen2 = Llama + q/k/v biases)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = "llama"
    # Qwen2 puts biases on q/k/v only; Llama's `attention_bias` also covers o_proj.
    attention_bias: bool = False
    attention_out_bias: bool = False
    mlp_bias: bool = False
    # Llama 3 style frequency scaling, as HF's rope_scaling dict ({"rope_type": "llama3", ...}).
    rope_scaling: dict[str, float | str] | None = field(default=None)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("head_dim", "intermediate_size", "max_position"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.rope_theta <= 0 or self.rms_norm_eps <= 0:
            raise ValueError("ModelConfig.rope_theta and rms_norm_eps must be > 0")
        self.eos_token_ids = tuple(int(t) for t in self.eos_token_ids)
        for tid in (
            *self.eos_token_ids,
            *(() if self.bos_token_id is None else (self.bos_token_id,)),
        ):
            if not 0 <= tid < self.vocab_size:
                raise ValueError(f"ModelConfig special token id {tid} outside vocab")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if kind not in ("default", "llama3"):
                raise ValueError(f"unsupported rope_scaling type {kind!r} (default, llama3)")

    def kv_bytes_per_token(self, element_size: int = 4) -> int:
        """KV cache bytes one token occupies (K and V, all layers) at `element_size` bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_size


@dataclass(slots=True)
class EngineConfig:
    """Capacity and batching limits of one engine instance."""

    block_size: int = 16
    num_blocks: int = 1024  # KV pool capacity in blocks
    max_running: int = 32  # requests decoding at once
    max_queued: int = 256  # requests waiting for admission; beyond this submit raises EngineFull
    max_batch_tokens: int = 2048  # new tokens one forward may process (prefill chunking bound)
    dtype: str = "float32"
    # Running decodes join a forward that extends other requests (one position each, first
    # in the token budget), as vLLM's chunked prefill and SGLang's --enable-mixed-chunk do;
    # off: extends run alone and every decode waits for them (agents/engine/scheduler.py).
    # The emulated engine turns it on (a long extend would otherwise freeze every stream of
    # its instance for the extend's whole modelled time); the torch engine keeps it off, so
    # its decode steps stay on the decode path its token checks cover.
    mixed_batches: bool = False
    # "int8": decode steps multiply by int8 weight-only copies of the linears (one scale per
    # output row, bf16 activations; CPU only, the float weights stay for prefill / extend).
    # "packed": by oneDNN-prepacked copies of the linears (the same values in oneDNN's blocked
    # layout: a second copy of the linears' weights; CPU only). "stream": by the skinny
    # kernel's packed copies (agents/engine/skinny.py: one sequential pass over each weight at
    # 1-64 rows, every decoder layer of a step in one C++ call; a second copy; x86 CPUs with
    # AVX-512 + AVX512-BF16 or AVX2 + FMA, elsewhere the default linears run, logged). None:
    # the model's own weights.
    # Speed, and agreement with float32: bench/engine/REPORT.md.
    decode_weights: str | None = None
    # Decode fast-path steps through torch.compile (inductor; needs a C++ compiler): one
    # graph per model, compiled on the first steps (tens of seconds), with a second, prepacked
    # copy of the linears' weights. CPU only; not with decode_weights. Measured in
    # bench/engine/REPORT.md ("torch.compile").
    decode_compile: bool = False
    seed: int = 0
    # Where the model and its KV pool live: "cpu", "cuda" or "cuda:N". The default comes from
    # BATON_ENGINE_DEVICE (unset: "cpu"), so a GPU server's agents are pointed at it once.
    device: str = field(default_factory=lambda: os.environ.get("BATON_ENGINE_DEVICE", "cpu"))

    def __post_init__(self) -> None:
        check_device_name(self.device)
        if self.block_size < 1:
            raise ValueError(f"EngineConfig.block_size must be >= 1, got {self.block_size}")
        if self.num_blocks < 1:
            raise ValueError(f"EngineConfig.num_blocks must be >= 1, got {self.num_blocks}")
        if self.max_running < 1:
            raise ValueError(f"EngineConfig.max_running must be >= 1, got {self.max_running}")
        if self.max_queued < 0:
            raise ValueError(f"EngineConfig.max_queued must be >= 0, got {self.max_queued}")
        if self.max_batch_tokens < 1:
            raise ValueError(
                f"EngineConfig.max_batch_tokens must be >= 1, got {self.max_batch_tokens}"
            )
        check_dtype_name(self.dtype)
        if self.decode_weights not in (None, "int8", "packed", "stream"):
            raise ValueError(
                "EngineConfig.decode_weights must be None, 'int8', 'packed' or 'stream', "
                f"got {self.decode_weights!r}"
            )
        if self.decode_weights is not None and self.device.partition(":")[0] != "cpu":
            raise ValueError(
                f"EngineConfig.decode_weights={self.decode_weights!r} is implemented for the "
                "CPU only"
            )
        if self.decode_compile and (
            self.decode_weights is not None or self.device.partition(":")[0] != "cpu"
        ):
            raise ValueError(
                "EngineConfig.decode_compile is implemented for the CPU, without decode_weights"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)

    @property
    def torch_device(self) -> torch.device:
        return parse_device(self.device)
