"""The engine core both engines share (agents/engine/interface.py): continuous batching via
`step()` and the prefill / export / import / extend calls the PDD pipelines are built from, over a
KV pool, a radix prefix cache and the scheduler. It loads no torch: the forward pass, sampling and
the model are the subclass's (`Engine`: PyTorch; `EmulatedEngine`: the hardware model). Not
thread-safe."""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from agents.engine.config import EngineConfig
from agents.engine.errors import EngineFull, PrefixMissing
from agents.engine.interface import ModelLimits
from agents.engine.kv_codec import decode_to
from agents.engine.kv_pool import KVPool, read_kv_header
from agents.engine.outputs import (
    EngineStats,
    GenerateResult,
    ImportResult,
    PrefillResult,
    TokenLogprob,
    TokenOutput,
)
from agents.engine.radix_cache import RadixCache
from agents.engine.request import (
    AfterForward,
    FinishReason,
    Request,
    RequestStatus,
    SamplingParams,
)
from agents.engine.scheduler import Scheduler


class EngineCore(ABC):
    """One model instance's scheduling: a KV pool, a radix prefix cache, the scheduler and the
    requests. Subclasses set the attributes below in ``__init__`` (then call
    ``_init_counters``) and implement the forward (``_step_once``)."""

    kind: str
    config: EngineConfig
    model_config: ModelLimits
    pool: KVPool
    cache: RadixCache
    scheduler: Scheduler
    requests: dict[str, Request]
    _undelivered: list[TokenOutput]
    # Called with other requests' outputs from each forward a command runs (prefill, extend,
    # import's recompute: ``_drive``), instead of keeping them for the next ``step()``: the
    # agent's worker sets it so that decoding streams get their tokens forward by forward
    # while a command holds the engine (a handoff's extend of 0.8 s modelled, repeated per
    # catch-up batch, held every stream of an MD past the gateway's stall limit).
    on_outputs: Callable[[list[TokenOutput]], None] | None = None

    def _init_counters(self) -> None:
        self._arrivals = itertools.count()
        self._generate_ids = itertools.count()
        self._tokens_computed = self._tokens_generated = self._forwards = 0

    # -- continuous batching -------------------------------------------------------------------

    def add_request(
        self, request_id: str, prompt_ids: Sequence[int], sampling: SamplingParams | None = None
    ) -> None:
        """Queue a request; its tokens arrive through `step()`. Raises EngineFull when full."""
        req = self._new_request(request_id, prompt_ids, sampling or SamplingParams())
        self.scheduler.submit(req)
        self.requests[request_id] = req

    def step(self) -> list[TokenOutput]:
        """Run one scheduler iteration; returns the new tokens (and finishes) per request.

        Returns [] when nothing could run, e.g. the queue head waits for KV blocks that held
        requests own; the caller should then wait for a release instead of spinning."""
        out, self._undelivered = self._undelivered, []
        return out + (self._step_once() or [])

    def has_work(self) -> bool:
        return bool(self._undelivered) or self.scheduler.has_work()

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is; its computed KV stays in the prefix cache."""
        return self._stop(request_id, FinishReason.ABORT)

    def release(self, request_id: str) -> bool:
        """Stop a request because its KV / decoding moved elsewhere (P after export, RLD after
        the handoff); its computed KV stays in the prefix cache."""
        return self._stop(request_id, FinishReason.RELEASED)

    # -- pipeline building blocks --------------------------------------------------------------

    def prefill(
        self, request_id: str, prompt_ids: Sequence[int], sampling: SamplingParams | None = None
    ) -> PrefillResult:
        """Compute the prompt's KV (reusing the cached prefix) and its first token, then hold
        the request so its KV can be exported; `release` it when done."""
        req = self._new_request(request_id, prompt_ids, sampling or SamplingParams())
        req.after_forward = AfterForward.SAMPLE_THEN_HOLD
        self.scheduler.submit(req)
        self.requests[request_id] = req
        (first,) = self._drive(req, lambda outs: bool(outs))
        return self.prefill_result(request_id, first)

    def submit_prefill(
        self, request_id: str, prompt_ids: Sequence[int], sampling: SamplingParams | None = None
    ) -> None:
        """Queue a prefill that is batched with the other requests (chunked prefill, continuous
        batching); its first token arrives through `step()` like any output, after which the
        request is held for export (`prefill_result`, then `release`). Raises EngineFull when
        the queue is full."""
        req = self._new_request(request_id, prompt_ids, sampling or SamplingParams())
        req.after_forward = AfterForward.SAMPLE_THEN_HOLD
        self.scheduler.submit(req)
        self.requests[request_id] = req

    def prefill_result(self, request_id: str, first: TokenOutput) -> PrefillResult:
        """What `prefill` returns, for a request queued by `submit_prefill` whose first output
        (`first`) has arrived."""
        req = self._get(request_id)
        return PrefillResult(
            first.token_ids[0],
            list(req.block_table),
            req.prompt_matched_tokens,
            first.finished,
            first.finish_reason,
            first.logprobs[0] if first.logprobs else None,
        )

    def export_kv(self, request_id: str, start_token: int, end_token: int) -> bytes:
        """KV of positions [start_token, end_token) of a request, in the kv_pool wire format."""
        req = self._get(request_id)
        if not 0 <= start_token <= end_token <= req.cached_len:
            raise ValueError(
                f"{request_id}: cannot export [{start_token}, {end_token}); KV covers "
                f"[0, {req.cached_len})"
            )
        return self.pool.export_kv(req.block_table, start_token, end_token)

    def import_prefix(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        start_token: int,
        payload: bytes,
        *,
        recompute_missing: bool = False,
    ) -> ImportResult:
        """Build a held request whose prompt KV is the local cached prefix [0, start_token)
        plus the received KV [start_token, len(prompt)); the received whole blocks join the
        prefix cache (the DRC). Follow with `start_decode`.

        When the cache holds less than [0, start_token) (the sender counted on KV that never
        arrived), raise `PrefixMissing`, or with `recompute_missing` compute the missing
        positions here first, from the prompt's token ids (one prefill of the prefix that
        reuses whatever part is cached): slower, but the request is served."""
        prompt = list(prompt_ids)
        header = read_kv_header(payload)
        own = getattr(self.pool, "dtype_name", header.dtype_name)
        if header.dtype_name != own:
            # Another format (a P of another dtype, or 8-bit transport across the WAN):
            # decoded into this engine's dtype first (agents/engine/kv_codec.py).
            payload = decode_to(payload, own)
            header = read_kv_header(payload)
        if (header.start_token, header.end_token) != (start_token, len(prompt)):
            raise ValueError(
                f"{request_id}: payload covers [{header.start_token}, {header.end_token}), "
                f"expected [{start_token}, {len(prompt)})"
            )
        if start_token % self.config.block_size:
            raise ValueError(f"start_token {start_token} is not a multiple of the block size")
        match = self.cache.match_prefix(prompt[:start_token])
        recomputed = 0
        if match.matched_tokens < start_token and recompute_missing:
            recomputed = start_token - match.matched_tokens
            self._fill_prefix(request_id, prompt[:start_token])
            match = self.cache.match_prefix(prompt[:start_token])
        if match.matched_tokens < start_token:
            raise PrefixMissing(
                f"{request_id}: payload starts at token {start_token} but this engine holds "
                f"only {match.matched_tokens} tokens of that prefix"
                + (" even after recomputing it" if recomputed else "")
            )
        req = self._new_request(request_id, prompt, SamplingParams())
        self.cache.lock(match.node)
        req.cache_node, req.block_table = match.node, list(match.blocks)
        req.cached_len = req.shared_len = start_token
        try:
            need = self.pool.blocks_for(header.num_tokens)
            if not self.scheduler.reserve(need):
                raise EngineFull(f"{request_id}: no room for {need} KV blocks")
            blocks = self.pool.allocate(need)
            req.block_table.extend(blocks)
            self.pool.import_kv(payload, blocks)
        except Exception:
            self.scheduler.release(req, keep_in_cache=False)
            raise
        req.cached_len = len(prompt)
        cached_before = self.cache.stats().cached_blocks
        self.scheduler.share_computed(req)
        self.cache.record_lookup(len(prompt), start_token)
        req.prompt_matched_tokens = start_token
        req.status = RequestStatus.HELD
        self.requests[request_id] = req
        return ImportResult(
            list(req.block_table),
            start_token,
            header.num_tokens,
            self.cache.stats().cached_blocks - cached_before,
            recomputed,
        )

    def _fill_prefix(self, request_id: str, prefix: list[int]) -> None:
        """Compute the KV of `prefix` (whole blocks) into the prefix cache and drop the rest:
        a prefill under a private id, released at once (its KV stays cached)."""
        fill_id = f"{request_id}#recompute"
        self.prefill(fill_id, prefix, SamplingParams(max_tokens=1))
        self.release(fill_id)

    def start_decode(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        first_token: int,
        sampling: SamplingParams | None = None,
        *,
        hold: bool = False,
    ) -> None:
        """Decode a request whose first token came from P. With an imported prefix the KV is
        used as is; without one, whatever the prefix cache lacks is recomputed. With `hold`
        the request waits for `extend` (the handoff target) instead of decoding."""
        sampling = sampling or SamplingParams()
        self._check_ids([first_token])
        req = self.requests.get(request_id)
        if req is None:
            # No imported KV: admission recomputes whatever the prefix cache lacks.
            req = self._new_request(request_id, prompt_ids, sampling)
            req.token_ids.append(first_token)
            if hold:
                req.status = RequestStatus.HELD
            elif self._stop_reason(req) is None:
                self.scheduler.submit(req)
            self.requests[request_id] = req
        elif req.status != RequestStatus.HELD or req.token_ids != list(prompt_ids):
            raise ValueError(f"{request_id}: not a held request with this prompt")
        else:
            req.sampling = sampling
            req.generator = self._generator(sampling, req.arrival)
            req.token_ids.append(first_token)
            if not hold and self._stop_reason(req) is None:
                self.scheduler.resume(req)
        reason = self._stop_reason(req)
        if reason is not None:
            self._finish(req, reason)
            self._undelivered.append(TokenOutput(request_id, [], True, reason))

    def extend(
        self, request_id: str, token_ids: Sequence[int], *, resume: bool = True
    ) -> TokenOutput | None:
        """Append k tokens generated elsewhere to a held request and compute their KV in one
        forward. With `resume`, sample the next token (returned) and keep decoding in `step()`;
        without it, stay held for the next batch of a catch-up handoff and return None."""
        req = self._get(request_id)
        if req.status != RequestStatus.HELD:
            raise ValueError(f"{request_id}: extend needs a held request, it is {req.status}")
        self._check_ids(token_ids)
        if req.num_output_tokens + len(token_ids) > req.sampling.max_tokens:
            raise ValueError(f"{request_id}: extending past max_tokens")
        req.token_ids.extend(token_ids)
        if req.extend_len == 0:
            raise ValueError(f"{request_id}: nothing to extend")
        req.after_forward = AfterForward.SAMPLE if resume else AfterForward.HOLD
        self.scheduler.resume(req)
        if not resume:
            self._drive(req, lambda _: req.status == RequestStatus.HELD)
            return None
        return self._drive(req, lambda outs: bool(outs))[0]

    def cached_prefix_len(self, prompt_ids: Sequence[int]) -> int:
        """Leading prompt tokens whose KV this engine's prefix cache holds (read-only)."""
        return self.cache.match_prefix(list(prompt_ids)).matched_tokens

    def generate(
        self,
        prompt_ids: Sequence[int],
        sampling: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> GenerateResult:
        """Run one request to completion on this engine (the `single` pipeline)."""
        request_id = request_id or f"generate-{next(self._generate_ids)}"
        self.add_request(request_id, prompt_ids, sampling)
        req = self.requests[request_id]
        outs = self._drive(req, lambda _: req.status == RequestStatus.FINISHED)
        logprobs = None
        if req.sampling.logprobs is not None:
            logprobs = [lp for out in outs for lp in out.logprobs or ()]
        assert req.finish_reason is not None, "a finished request has its reason"
        return GenerateResult(
            req.output_ids, req.finish_reason, req.prompt_matched_tokens, logprobs
        )

    def has_decode_slot(self) -> bool:
        """Whether one more request would start decoding without queueing: fewer requests
        running or waiting than ``max_running`` (held requests take no slot until resumed)."""
        return len(self.scheduler.running) + len(self.scheduler.waiting) < self.config.max_running

    def stats(self) -> EngineStats:
        cache = self.cache.stats()
        held = sum(r.status == RequestStatus.HELD for r in self.requests.values())
        return EngineStats(
            running=len(self.scheduler.running),
            queued=len(self.scheduler.waiting),
            held=held,
            kv_blocks_used=self.pool.num_used_blocks,
            kv_blocks_total=self.pool.num_blocks,
            cached_blocks=cache.cached_blocks,
            cache_lookups=cache.lookups,
            cache_hits=cache.hits,
            cache_queried_tokens=cache.queried_tokens,
            cache_matched_tokens=cache.matched_tokens,
            tokens_computed=self._tokens_computed,
            tokens_generated=self._tokens_generated,
            forwards=self._forwards,
            preemptions=self.scheduler.num_preemptions,
        )

    @abstractmethod
    def _step_once(self) -> list[TokenOutput] | None:
        """Run the scheduler's next batch: its forward, its sampled tokens; None when nothing
        could run."""

    @abstractmethod
    def _generator(self, sampling: SamplingParams, arrival: int) -> Any:
        """The random source of a sampled request (None when greedy)."""

    @abstractmethod
    def represented_bytes(self, payload: bytes) -> int:
        """The KV bytes a payload of `export_kv` stands for."""

    @abstractmethod
    def describe(self) -> dict[str, Any]:
        """What this engine is, for the agent's state document."""

    # -- internals -----------------------------------------------------------------------------

    def _deliver(
        self,
        complete: list[Request],
        sampled: list[int],
        tokens: list[int],
        logprobs: Mapping[int, TokenLogprob],
    ) -> list[TokenOutput]:
        """After a forward: hold the requests whose forward was KV only; append each sampled
        token (``tokens[j]`` for ``complete[sampled[j]]``, with ``logprobs`` by index into
        ``complete``) and emit it; hold P's request after its first token, finish the ones
        that stop."""
        for req in complete:
            if req.after_forward == AfterForward.HOLD:
                self.scheduler.hold(req)
        self._tokens_generated += len(tokens)
        outputs = []
        for i, token in zip(sampled, tokens, strict=True):
            req = complete[i]
            req.token_ids.append(token)
            reason = self._stop_reason(req)
            lp = logprobs.get(i)
            outputs.append(
                TokenOutput(
                    req.request_id,
                    [token],
                    reason is not None,
                    reason,
                    None if lp is None else [lp],
                )
            )
            if req.after_forward == AfterForward.SAMPLE_THEN_HOLD:
                req.after_forward = AfterForward.SAMPLE
                self.scheduler.hold(req)
            elif reason is not None:
                self._finish(req, reason)
        return outputs

    def _sampling_seed(self, sampling: SamplingParams, arrival: int) -> int:
        """A sampled request's seed: its own, else derived from the engine's and its arrival."""
        if sampling.seed is not None:
            return sampling.seed
        return self.config.seed * 1_000_003 + arrival

    def _drive(self, req: Request, done: Callable[[list[TokenOutput]], bool]) -> list[TokenOutput]:
        """Step until `done(outputs of req so far)`; other requests' outputs wait for `step()`."""
        mine: list[TokenOutput] = []
        try:
            while not done(mine):
                outputs = self._step_once()
                if outputs is None:
                    raise EngineFull(
                        f"{req.request_id}: cannot be scheduled; KV blocks are held elsewhere"
                    )
                others: list[TokenOutput] = []
                for out in outputs:
                    (mine if out.request_id == req.request_id else others).append(out)
                if others:
                    if self.on_outputs is None:
                        self._undelivered.extend(others)
                    else:
                        earlier, self._undelivered = self._undelivered, []
                        self.on_outputs(earlier + others)
        except BaseException:
            if req.status != RequestStatus.FINISHED:
                self.abort(req.request_id)
            raise
        return mine

    def _new_request(
        self, request_id: str, prompt_ids: Sequence[int], sampling: SamplingParams
    ) -> Request:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt = list(prompt_ids)
        if not prompt:
            raise ValueError("prompt must have at least one token")
        if len(prompt) >= self.model_config.max_position:
            raise ValueError(f"prompt of {len(prompt)} tokens reaches the model's max_position")
        self._check_ids(prompt)
        arrival = next(self._arrivals)
        return Request(
            request_id,
            prompt,
            len(prompt),
            sampling,
            arrival,
            generator=self._generator(sampling, arrival),
        )

    def _check_ids(self, ids: Sequence[int]) -> None:
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"token ids must be in [0, {vocab})")

    def _stop_reason(self, req: Request) -> str | None:
        last, params = req.token_ids[-1], req.sampling
        if (not params.ignore_eos and last in self.model_config.eos_token_ids) or (
            last in params.stop_token_ids
        ):
            return FinishReason.STOP
        if req.num_output_tokens >= params.max_tokens:
            return FinishReason.LENGTH
        if req.device_len >= self.model_config.max_position:
            return FinishReason.LENGTH
        return None

    def _get(self, request_id: str) -> Request:
        req = self.requests.get(request_id)
        if req is None:
            raise KeyError(f"unknown request {request_id!r}")
        return req

    def _finish(self, req: Request, reason: str) -> None:
        self.scheduler.finish(req, reason)
        self.requests.pop(req.request_id, None)

    def _stop(self, request_id: str, reason: str) -> bool:
        req = self.requests.get(request_id)
        if req is None:
            return False
        self._finish(req, reason)
        return True
