"""The engine interface the node agent drives: what an engine instance must offer, whichever
engine it is. Two implement it: the PyTorch engine (`Engine`, a real model over real KV
tensors) and the emulated engine (`EmulatedEngine`: the same scheduler, KV pool accounting and
radix cache, step times from the hardware model, deterministic tokens; agents/engine/emulated.py).
The agent, its pipelines and its worker thread use nothing else of an engine."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from agents.engine.config import EngineConfig
from agents.engine.kv_pool import KVPool
from agents.engine.outputs import (
    EngineStats,
    GenerateResult,
    ImportResult,
    PrefillResult,
    TokenOutput,
)
from agents.engine.radix_cache import RadixCache
from agents.engine.request import Request, SamplingParams

# The `kind` an engine reports in the agent's state document, /metrics and the records.
TORCH = "torch"
EMULATED = "emulated"
ENGINE_KINDS = (TORCH, EMULATED)


class ModelLimits(Protocol):
    """The model facts an agent checks requests against (ModelConfig has them)."""

    vocab_size: int
    max_position: int
    eos_token_ids: tuple[int, ...]


@runtime_checkable
class InferenceEngine(Protocol):
    """One model instance with one paged KV pool and one radix prefix cache. Not thread-safe:
    one thread (agents/node/worker.py) makes every call. Mutating calls are marked."""

    kind: str  # TORCH or EMULATED
    config: EngineConfig
    model_config: ModelLimits
    pool: KVPool
    cache: RadixCache
    requests: dict[str, Request]

    # -- continuous batching --------------------------------------------------------------

    def add_request(
        self, request_id: str, prompt_ids: Sequence[int], sampling: SamplingParams | None = None
    ) -> None:
        """Mutates: queue a request; its tokens arrive through `step()` (EngineFull if full)."""

    def step(self) -> list[TokenOutput]:
        """Mutates: one scheduler iteration; [] when nothing could run."""

    def has_work(self) -> bool:
        """Read-only: whether `step()` would do anything."""

    def abort(self, request_id: str) -> bool:
        """Mutates: stop a request; its computed KV stays in the prefix cache."""

    def release(self, request_id: str) -> bool:
        """Mutates: stop a request whose KV or decoding moved to another engine."""

    # -- pipeline building blocks ---------------------------------------------------------

    def prefill(
        self, request_id: str, prompt_ids: Sequence[int], sampling: SamplingParams | None = None
    ) -> PrefillResult:
        """Mutates: compute the prompt's KV and first token, then hold it for export."""

    def submit_prefill(
        self, request_id: str, prompt_ids: Sequence[int], sampling: SamplingParams | None = None
    ) -> None:
        """Mutates: queue a prefill batched with the other requests; its first token arrives
        through `step()`, then it is held for export."""

    def prefill_result(self, request_id: str, first: TokenOutput) -> PrefillResult:
        """Read-only: `prefill`'s result for a request `submit_prefill` queued, once its first
        output has arrived."""

    def export_kv(self, request_id: str, start_token: int, end_token: int) -> bytes:
        """Read-only: KV of positions [start_token, end_token) in this engine's wire format."""

    def import_prefix(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        start_token: int,
        payload: bytes,
        *,
        recompute_missing: bool = False,
    ) -> ImportResult:
        """Mutates: a held request from the cached prefix plus the received KV."""

    def start_decode(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        first_token: int,
        sampling: SamplingParams | None = None,
        *,
        hold: bool = False,
    ) -> None:
        """Mutates: decode a request whose first token came from P (or hold it for extend)."""

    def extend(
        self, request_id: str, token_ids: Sequence[int], *, resume: bool = True
    ) -> TokenOutput | None:
        """Mutates: append k tokens generated elsewhere and compute their KV in one forward."""

    def cached_prefix_len(self, prompt_ids: Sequence[int]) -> int:
        """Read-only: leading prompt tokens the prefix cache holds."""

    def generate(
        self,
        prompt_ids: Sequence[int],
        sampling: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> GenerateResult:
        """Mutates: run one request to completion (the `single` pipeline)."""

    def has_decode_slot(self) -> bool:
        """Read-only: whether one more request would decode without queueing."""

    def stats(self) -> EngineStats:
        """Read-only: counters and occupancy."""

    def represented_bytes(self, payload: bytes) -> int:
        """Read-only: the KV bytes a payload of `export_kv` stands for: its length for real KV,
        the length times kv_scale for an emulated engine's (docs/emulation.md)."""

    def describe(self) -> dict[str, Any]:
        """Read-only: what this engine is, for the agent's state document (kind, model, and
        for an emulated engine its GPU unit and timing)."""
