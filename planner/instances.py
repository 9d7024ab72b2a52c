"""Simulated engine instances: a batching prefill server and a batching decode server.

Each wraps a ``routing.policy.InstanceState`` that it keeps current, so the policy reads the
simulated fleet exactly as the gateway reads the real one.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Callable

from planner.events import EventLoop
from planner.hardware import (
    EngineSpec,
    GpuType,
    ModelSpec,
    decode_step_time,
    prefill_batch_time,
)
from routing.policy import InstanceState


class PrefillInstance:
    """FIFO prefill with batching: one forward pass takes whole requests up to a token budget.

    A pass costs a fixed overhead per chunk of ``prefill_batch_tokens`` plus its FLOPs at the
    unit's efficient peak, so small tail chunks that cannot batch pay the overhead nearly alone.
    """

    def __init__(
        self,
        state: InstanceState,
        gpu: GpuType,
        model: ModelSpec,
        engine: EngineSpec,
        loop: EventLoop,
    ) -> None:
        self.state = state
        self.gpu = gpu
        self.model = model
        self.engine = engine
        self.loop = loop
        self.queue: deque[tuple[int, int, int, Callable[[int], None]]] = deque()
        self.busy = False
        self.backlog_tokens = 0
        self.busy_s = 0.0
        self.tokens = 0  # new (uncached) prompt tokens computed

    def submit(self, req: int, new_tokens: int, cached_tokens: int, done: Callable[[int], None]):
        self.queue.append((req, new_tokens, cached_tokens, done))
        self.backlog_tokens += new_tokens
        # Load as backlog in units of eight full batches: only the order matters to the policy.
        self.state.load = self.backlog_tokens / (8 * self.engine.prefill_batch_tokens)
        if not self.busy:
            self._start_batch()

    def _start_batch(self) -> None:
        budget = self.engine.prefill_batch_tokens
        batch = []
        tokens = 0
        flops = 0.0
        while self.queue and (not batch or tokens + self.queue[0][1] <= budget):
            item = self.queue.popleft()
            batch.append(item)
            tokens += item[1]
            flops += self.model.prefill_flops(item[1], item[2])
        chunks = max(1, math.ceil(tokens / budget))
        seconds = prefill_batch_time(flops, self.gpu, self.engine)
        seconds += (chunks - 1) * self.engine.prefill_overhead_s
        self.busy = True
        self.busy_s += seconds
        self.loop.at(self.loop.now + seconds, self._finish_batch, batch, tokens)

    def _finish_batch(self, batch: list, tokens: int) -> None:
        self.backlog_tokens -= tokens
        self.tokens += tokens
        self.state.load = self.backlog_tokens / (8 * self.engine.prefill_batch_tokens)
        self.busy = False
        if self.queue:
            self._start_batch()
        for req, _, _, done in batch:
            done(req)


class DecodeInstance:
    """Continuous-batching decode: a request's step time is set by the batch it joins.

    A step reads the weights plus every running request's KV once, so TPOT grows with the
    batch's total context. Requests beyond ``max_decode_batch`` or the KV memory wait FIFO.
    On MD it also holds the decode-side prefix cache (DRC): session -> tokens of its context,
    LRU-evicted to a capacity.
    """

    def __init__(
        self,
        state: InstanceState,
        gpu: GpuType,
        model: ModelSpec,
        engine: EngineSpec,
        loop: EventLoop,
        kv_capacity_tokens: int,
        cache_capacity_tokens: int = 0,
    ) -> None:
        self.state = state
        self.gpu = gpu
        self.model = model
        self.engine = engine
        self.loop = loop
        self.kv_capacity = kv_capacity_tokens
        self.running = 0
        self.ctx_sum = 0
        self.queue: deque[tuple[int, Callable[[float], None]]] = deque()
        self.tokens = 0  # output tokens this instance produced
        self.cache: OrderedDict[int, tuple[int, int]] = OrderedDict()
        self.cache_tokens = 0
        self.cache_capacity = cache_capacity_tokens

    # --- batch slots --------------------------------------------------------------------------
    def admit(self, ctx_tokens: int, start: Callable[[float], None]) -> None:
        """Start now if a slot and KV memory are free, else queue; ``start(tpot)`` runs then."""
        if not self.queue and self._fits(ctx_tokens):
            self._start(ctx_tokens, start)
        else:
            self.queue.append((ctx_tokens, start))
            self._update_load()

    def release(self, ctx_tokens: int) -> None:
        self.running -= 1
        self.ctx_sum -= ctx_tokens
        while self.queue and self._fits(self.queue[0][0]):
            ctx, start = self.queue.popleft()
            self._start(ctx, start)
        self._update_load()

    def step_time(self) -> float:
        return decode_step_time(self.ctx_sum, self.model, self.gpu, self.engine)

    def _fits(self, ctx_tokens: int) -> bool:
        if self.running == 0:
            return True  # an oversized request still runs alone
        return (
            self.running < self.engine.max_decode_batch
            and self.ctx_sum + ctx_tokens <= self.kv_capacity
        )

    def _start(self, ctx_tokens: int, start: Callable[[float], None]) -> None:
        self.running += 1
        self.ctx_sum += ctx_tokens
        self._update_load()
        start(self.step_time())

    def _update_load(self) -> None:
        self.state.load = (self.running + len(self.queue)) / self.engine.max_decode_batch
        self.state.queue_depth = len(self.queue)

    # --- decode-side prefix cache ----------------------------------------------------------------
    # An entry is (version, tokens): ``version`` is the session's append counter when this MD
    # last ingested its context. A request's reusable prefix minus what the session appended
    # since that version is what this MD still holds of it (a stale copy covers less).
    def cached_version(self, session: int) -> int | None:
        entry = self.cache.get(session)
        return entry[0] if entry is not None else None

    def cache_put(self, session: int, version: int, tokens: int) -> None:
        """Record that this MD holds the session's context at ``version`` (mutates the LRU)."""
        old = self.cache.pop(session, None)
        if old is not None:
            self.cache_tokens -= old[1]
            version = max(version, old[0])  # an older turn finishing late must not regress it
        self.cache_tokens += tokens
        self.cache[session] = (version, tokens)
        while self.cache_tokens > self.cache_capacity and self.cache:
            _, (_, evicted) = self.cache.popitem(last=False)
            self.cache_tokens -= evicted
