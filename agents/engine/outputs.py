"""Results the engine hands back to the agent: per-step tokens, prefill / import / generate
results and the engine's counters."""

from __future__ import annotations

from typing import NamedTuple


class TokenLogprob(NamedTuple):
    """A sampled token's log-probability under the raw model distribution (log-softmax of
    its logits, before temperature and top-p) and the `SamplingParams.logprobs` most likely
    tokens as (token id, logprob), most likely first."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class TokenOutput(NamedTuple):
    request_id: str
    token_ids: list[int]  # tokens produced for this request by this call (0 or 1 per step)
    finished: bool
    finish_reason: str | None
    # One per token id when the request asked for logprobs (SamplingParams.logprobs), else None.
    logprobs: list[TokenLogprob] | None = None


class PrefillResult(NamedTuple):
    first_token: int
    block_table: list[int]
    cached_tokens: int  # prompt positions reused from this engine's prefix cache
    finished: bool  # the first token already ends the request (EOS, stop token, max_tokens=1)
    finish_reason: str | None
    first_logprob: TokenLogprob | None = None  # when the request asked for logprobs


class ImportResult(NamedTuple):
    block_table: list[int]
    local_tokens: int  # prompt positions taken from the local prefix cache (= start_token)
    received_tokens: int  # prompt positions written from the payload
    new_cached_blocks: int  # received whole blocks the prefix cache did not hold before
    # Prefix positions this engine computed itself because its cache lacked them (the KV
    # counted on, e.g. an earlier turn's still in flight, never landed); 0 normally.
    recomputed_tokens: int = 0


class GenerateResult(NamedTuple):
    output_ids: list[int]
    finish_reason: str
    cached_tokens: int
    logprobs: list[TokenLogprob] | None = None  # one per output id, when asked for


class EngineStats(NamedTuple):
    running: int
    queued: int
    held: int
    kv_blocks_used: int
    kv_blocks_total: int
    cached_blocks: int
    cache_lookups: int
    cache_hits: int
    cache_queried_tokens: int
    cache_matched_tokens: int
    tokens_computed: int  # positions run through the model (prefill, extend, decode)
    tokens_generated: int  # tokens sampled
    forwards: int
    preemptions: int

    @property
    def cache_hit_rate(self) -> float:
        """Fraction of looked-up prompt tokens served from the prefix cache."""
        if not self.cache_queried_tokens:
            return 0.0
        return self.cache_matched_tokens / self.cache_queried_tokens
