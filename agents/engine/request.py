"""Request state for the engine: token ids plus how many leading positions already have KV
(`cached_len`), so prefill, extend and the handoff's recompute are one step: run the
`extend_len` positions that lack KV."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from agents.engine.radix_cache import TreeNode

if TYPE_CHECKING:
    import torch

MAX_LOGPROBS = 20  # alternatives per token (OpenAI's top_logprobs bound)


@dataclass(slots=True)
class SamplingParams:
    """How a request picks tokens and when it stops."""

    max_tokens: int = 16  # output tokens, counting ones generated elsewhere and handed over
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None  # None: derived from the engine seed and the request's arrival
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Log-probabilities to return with each sampled token: None = none (no cost), 0 = the
    # sampled token's, k = it plus the k most likely tokens. They are the raw model's
    # (log-softmax of the logits, before temperature and top-p), as vLLM returns by default.
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(
                f"SamplingParams.logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued for admission (KV blocks, a running slot)
    RUNNING = "running"  # scheduled every step until it finishes
    HELD = "held"  # KV present but not scheduled: exported by P, or awaiting a handoff
    FINISHED = "finished"


class FinishReason:
    STOP = "stop"  # EOS or a stop token
    LENGTH = "length"  # max_tokens or the model's max_position
    ABORT = "abort"
    RELEASED = "released"  # stopped here on purpose: the KV went on to another engine


class AfterForward(enum.Enum):
    """What happens once a forward has computed KV for all of a request's tokens."""

    SAMPLE = "sample"  # sample the next token and keep decoding
    SAMPLE_THEN_HOLD = "sample_then_hold"  # sample the first token, then hold (prefill on P)
    HOLD = "hold"  # no token: KV only (a catch-up handoff batch)


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    token_ids: list[int]  # prompt followed by output tokens
    num_prompt_tokens: int
    sampling: SamplingParams
    arrival: int  # admission order; the newest running request is preempted first
    status: RequestStatus = RequestStatus.WAITING
    after_forward: AfterForward = AfterForward.SAMPLE
    cached_len: int = 0  # leading positions whose KV is in block_table
    shared_len: int = 0  # leading positions whose blocks the radix cache owns (pinned)
    block_table: list[int] = field(default_factory=list)
    cache_node: TreeNode | None = None  # pinned radix node covering the shared blocks
    finish_reason: str | None = None
    # torch.Generator on the torch engine, random.Random on the emulated one; None: greedy.
    generator: torch.Generator | Any | None = None
    prompt_matched_tokens: int = 0  # prefix-cache hit at first admission (for reporting)

    @property
    def device_len(self) -> int:
        """Positions that will have KV once the pending tokens are run."""
        return len(self.token_ids)

    @property
    def extend_len(self) -> int:
        """Positions still lacking KV: a whole prompt, a handoff's k tokens, or 1 when decoding."""
        return self.device_len - self.cached_len

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]
