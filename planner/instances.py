"""Simulated engine instances: a batching prefill server and a batching decode server.

Each wraps a ``pdd.policy.InstanceState`` that it keeps current, so the policy reads the
simulated fleet exactly as the gateway reads the real one.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Callable

from pdd.hardware import (
    EngineSpec,
    GpuType,
    ModelSpec,
    prefill_batch_time,
)
from pdd.policy import InstanceState
from planner.events import EventLoop


class PrefillInstance:
    """Chunked prefill: a pass holds at most ``prefill_batch_tokens`` new tokens.

    A request longer than the budget is cut into budget-sized chunks from its start; each chunk
    attends to the cached prefix plus the chunks before it. A pass takes the head request's next
    chunk; if that chunk ends the request (a tail, or a short request), the rest of the budget is
    filled with whole queued requests that fit, in order. A long request behind it is not split
    to fill the gap (chunk boundaries stay fixed within each request), so a small tail in front
    of long requests runs nearly alone, at the low efficiency of a small pass (see
    ``hardware.prefill_efficiency``).

    The order is the engine's ``prefill_order``: "fifo" keeps arrival order (a chunked request
    holds the head until it is done); "srpt" serves the request with the fewest new tokens left
    first, chosen again before every pass, so short requests overtake a long one between its
    chunks.
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
        # [request, new tokens left, context already there (cached + done chunks), done]
        self.queue: deque[list] = deque()  # "fifo"
        self.heap: list[tuple[int, int, list]] = []  # "srpt": (new tokens left, arrival, item)
        self.srpt = engine.prefill_order == "srpt"
        self._arrivals = 0
        self.busy = False
        self.backlog_tokens = 0
        self.busy_s = 0.0
        self.tokens = 0  # new (uncached) prompt tokens computed
        self.passes = 0
        # A list the simulator ranks instances by, and this one's slot: kept = state.load.
        self.rank_keys: list | None = None
        self.rank_idx = 0

    def submit(self, req: int, new_tokens: int, cached_tokens: int, done: Callable[[int], None]):
        self._push([req, new_tokens, cached_tokens, done])
        self.backlog_tokens += new_tokens
        # Load as backlog in units of eight full batches: only the order matters to the policy.
        self.state.load = load = self.backlog_tokens / (8 * self.engine.prefill_batch_tokens)
        if self.rank_keys is not None:
            self.rank_keys[self.rank_idx] = load
        if not self.busy:
            self._start_batch()

    def _push(self, item: list) -> None:
        if self.srpt:
            self._arrivals += 1
            heapq.heappush(self.heap, (item[1], self._arrivals, item))
        else:
            self.queue.append(item)

    def _peek(self) -> list | None:
        if self.srpt:
            return self.heap[0][2] if self.heap else None
        return self.queue[0] if self.queue else None

    def _pop(self) -> list:
        return heapq.heappop(self.heap)[2] if self.srpt else self.queue.popleft()

    @property
    def queued(self) -> int:
        """Requests waiting or being prefilled."""
        return len(self.heap) if self.srpt else len(self.queue)

    def _start_batch(self) -> None:
        budget = self.engine.prefill_batch_tokens
        head = self._peek()
        assert head is not None  # a batch starts only with a request queued
        chunk = min(head[1], budget)
        flops = self.model.prefill_flops(chunk, head[2])
        tokens = chunk
        finished = []
        if chunk >= head[1]:
            finished.append(self._pop())
            while (nxt := self._peek()) is not None and tokens + nxt[1] <= budget:
                item = self._pop()
                tokens += item[1]
                flops += self.model.prefill_flops(item[1], item[2])
                finished.append(item)
        elif self.srpt:  # re-queued under its smaller remainder
            self._pop()
            head[1] -= chunk
            head[2] += chunk
            self._push(head)
        else:
            head[1] -= chunk
            head[2] += chunk
        seconds = prefill_batch_time(flops, self.gpu, self.engine, tokens)
        self.busy = True
        self.busy_s += seconds
        self.passes += 1
        self._begin_pass(seconds, finished, tokens)

    def _begin_pass(self, seconds: float, finished: list, tokens: int) -> None:
        """The pass of ``seconds`` ends then (on a shared host, ``planner.host``: later)."""
        self.loop.at(self.loop.now + seconds, self._finish_batch, finished, tokens)

    def _finish_batch(self, finished: list, tokens: int) -> None:
        self.backlog_tokens -= tokens
        self.tokens += tokens
        self.state.load = load = self.backlog_tokens / (8 * self.engine.prefill_batch_tokens)
        if self.rank_keys is not None:
            self.rank_keys[self.rank_idx] = load
        self.busy = False
        if self.queued:
            self._start_batch()
        for req, _, _, done in finished:
            done(req)


class DecodeInstance:
    """Continuous-batching decode whose step time follows the batch as it changes.

    A step reads the weights plus every running request's KV once, so the step time grows with
    the batch's total context. Every running request gains one token per step, so the instance
    keeps one token clock (tokens each running request has produced since the instance began)
    that advances at 1 / step_time; a request that starts at clock c finishes its n tokens when
    the clock reaches c + n, however the batch changed meanwhile. Each admission or release
    recomputes the step time. Requests beyond ``max_decode_batch`` or the KV memory wait FIFO.
    On MD it also holds the decode-side prefix cache (DRC): session -> tokens of its context,
    LRU-evicted to a capacity.

    The next mark's event is rescheduled whenever the step time or the marks change; a
    superseded event is skipped when it comes due (``_version``). Where a change is certain to
    be followed by another within the same call (an admission's start callback, a mark's done
    callbacks), the event is held back and pushed only if nothing superseded it, under the
    sequence number it would have had: the loop runs the same events in the same order.
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
        holders: dict[int, dict[str, DecodeInstance]] | None = None,
    ) -> None:
        self.state = state
        self.gpu = gpu
        self.model = model
        self.engine = engine
        self.loop = loop
        self.kv_capacity = kv_capacity_tokens
        self.max_batch = engine.max_decode_batch
        self.running = 0
        self.ctx_sum = 0
        # Requests routed here whose KV has not arrived yet (still in prefill or transfer): a
        # router counts its own dispatches, or every decision in a prefill's worth of seconds
        # would pick the same least-loaded instance.
        self.assigned = 0
        self.queue: deque[tuple[int, Callable[[float, float], None]]] = deque()
        self.tokens = 0  # output tokens this instance produced
        self.cache: OrderedDict[int, tuple[int, int]] = OrderedDict()
        self.cache_tokens = 0
        self.cache_capacity = cache_capacity_tokens
        # KV on its way to this MD: session -> {version: callbacks waiting for it to land}.
        self.incoming: dict[int, dict[int, list[Callable[[], None]]]] = {}
        # Optional index shared by a fleet's MDs: session -> the MDs that have held or been
        # sent its context (a superset of those that hold it now), so a router looks at those
        # few instead of every MD's cache.
        self.holders = holders
        # decode_step_time's terms that do not change: weight bytes by batch, the divisor.
        self._weight_bytes: dict[int, float] = {}
        self._overhead_s = engine.decode_overhead_s
        self._kv_bytes = model.kv_bytes_per_token
        self._bytes_per_s = gpu.mem_bw_tbps * 1e12 * engine.decode_mem_efficiency
        # Token clock.
        self.clock = 0.0
        self._last = 0.0
        self.step = self.step_time()
        self._marks: list[tuple[float, int, Callable[..., None], tuple]] = []
        self._seq = 0
        self._version = 0
        # A list the simulator ranks instances by, and this one's slot: kept = (load, queue).
        self.rank_keys: list | None = None
        self.rank_idx = 0

    # --- batch slots --------------------------------------------------------------------------
    def assign(self) -> None:
        """A request has been routed here; its KV is on the way (counts in the load)."""
        self.assigned += 1
        self._update_load()

    def unassign(self) -> None:
        """A routed request's KV arrived (it is admitted next) or it will not come."""
        self.assigned = max(0, self.assigned - 1)
        self._update_load()

    def admit(self, ctx_tokens: int, start: Callable[[float, float], None]) -> None:
        """Start now if a slot and KV memory are free, else queue.

        ``start(tpot, job)`` runs at the start: ``tpot`` is the step time then (the first token
        comes one step later), ``job`` the clock value to pass to :meth:`run` / :meth:`produced`.
        """
        if not self.queue and self._fits(ctx_tokens):
            self._start(ctx_tokens, start)
        else:
            self.queue.append((ctx_tokens, start))
            self._update_load()

    # The methods below run for every decode step change; ``_advance``, ``_update_load``,
    # ``step_time`` and ``_reschedule`` are written out in them (the same arithmetic).
    def release(self, ctx_tokens: int) -> None:
        now = self.loop.now
        if now > self._last:
            self.clock += (now - self._last) / self.step
            self._last = now
        self.running -= 1
        self.ctx_sum -= ctx_tokens
        queue = self.queue
        while queue and self._fits(queue[0][0]):
            ctx, start = queue.popleft()
            self._start(ctx, start)
        self._update_load()
        self.step = self.step_time()
        self._reschedule()

    def run(self, job: float, tokens: float, done: Callable[..., None], *args) -> None:
        """Call ``done(*args)`` when the request started at ``job`` has made ``tokens`` steps."""
        now = self.loop.now
        if now > self._last:
            self.clock += (now - self._last) / self.step
            self._last = now
        self._seq += 1
        heapq.heappush(self._marks, (job + tokens, self._seq, done, args))
        self._reschedule()

    def produced(self, job: float) -> float:
        """Steps the request started at ``job`` has made by now."""
        self._advance()
        return self.clock - job

    def step_time(self) -> float:
        """decode_step_time(ctx_sum, model, gpu, engine, max(running, 1)), the same float."""
        batch = self.running if self.running > 1 else 1
        weights = self._weight_bytes.get(batch)
        if weights is None:
            weights = self._weight_bytes[batch] = self.model.decode_weight_bytes(batch)
        return self._overhead_s + (weights + self.ctx_sum * self._kv_bytes) / self._bytes_per_s

    def _fits(self, ctx_tokens: int) -> bool:
        if self.running == 0:
            return True  # an oversized request still runs alone
        return self.running < self.max_batch and self.ctx_sum + ctx_tokens <= self.kv_capacity

    def _start(self, ctx_tokens: int, start: Callable[[float, float], None]) -> None:
        loop = self.loop
        now = loop.now
        if now > self._last:
            self.clock += (now - self._last) / self.step
            self._last = now
        self.running = running = self.running + 1
        self.ctx_sum = ctx_sum = self.ctx_sum + ctx_tokens
        state = self.state
        queued = len(self.queue)
        state.load = load = (running + queued + self.assigned) / self.max_batch
        state.queue_depth = queued
        if self.rank_keys is not None:
            self.rank_keys[self.rank_idx] = (load, queued)
        batch = running if running > 1 else 1
        weights = self._weight_bytes.get(batch)
        if weights is None:
            weights = self._weight_bytes[batch] = self.model.decode_weight_bytes(batch)
        self.step = step = (
            self._overhead_s + (weights + ctx_sum * self._kv_bytes) / self._bytes_per_s
        )
        # The mark event is held back: start() nearly always runs or releases, which
        # reschedules; it is pushed, under the sequence number it would have had, otherwise.
        self._version = version = self._version + 1
        if self._marks:
            loop._seq += 1
            seq = loop._seq
            start(step, self.clock)
            if version == self._version:  # nothing superseded it: the same time as then
                left = self._marks[0][0] - self.clock
                if left < 0.0:
                    left = 0.0
                heapq.heappush(loop._heap, (now + left * step, seq, self._on_mark, (version,)))
        else:
            start(step, self.clock)

    def _advance(self) -> None:
        now = self.loop.now
        if now > self._last:
            self.clock += (now - self._last) / self.step
            self._last = now

    def _reschedule(self) -> None:
        self._version = version = self._version + 1
        if self._marks:
            left = self._marks[0][0] - self.clock
            if left < 0.0:
                left = 0.0
            loop = self.loop
            loop._seq += 1  # loop.at, inline (the time is never in the past)
            heapq.heappush(
                loop._heap, (loop.now + left * self.step, loop._seq, self._on_mark, (version,))
            )

    def _on_mark(self, version: int) -> None:
        if version != self._version:
            return  # the step time or the marks changed since this was scheduled
        loop = self.loop
        now = loop.now
        if now > self._last:
            self.clock += (now - self._last) / self.step
            self._last = now
        marks = self._marks
        due = []
        limit = self.clock + 1e-6
        while marks and marks[0][0] <= limit:
            due.append(heapq.heappop(marks))
        # The done callbacks release, which reschedules: the event is held back as in _start.
        self._version = version = self._version + 1
        if not marks:
            for _, _, done, args in due:
                done(*args)
            return
        loop._seq += 1
        seq = loop._seq
        for _, _, done, args in due:
            done(*args)
        if version == self._version:
            left = marks[0][0] - self.clock
            if left < 0.0:
                left = 0.0
            heapq.heappush(loop._heap, (now + left * self.step, seq, self._on_mark, (version,)))

    def _update_load(self) -> None:
        state = self.state
        queued = len(self.queue)
        state.load = load = (self.running + queued + self.assigned) / self.max_batch
        state.queue_depth = queued
        if self.rank_keys is not None:
            self.rank_keys[self.rank_idx] = (load, queued)

    # --- decode-side prefix cache ----------------------------------------------------------------
    # An entry is (version, tokens): ``version`` is the session's append counter when this MD
    # last ingested its context. A request's reusable prefix minus what the session appended
    # since that version is what this MD still holds of it (a stale copy covers less).
    def cached_version(self, session: int) -> int | None:
        entry = self.cache.get(session)
        return entry[0] if entry is not None else None

    def expect(self, session: int, version: int) -> None:
        """P has committed to send this session's context at ``version`` to this MD."""
        pending = self.incoming.get(session)
        if pending is None:
            self.incoming[session] = {version: []}
        elif version not in pending:
            pending[version] = []
        if self.holders is not None:
            held = self.holders.get(session)
            if held is None:
                self.holders[session] = {self.state.id: self}
            else:
                held[self.state.id] = self

    def incoming_version(self, session: int) -> int | None:
        """Newest version of the session's context still on its way here, if any."""
        pending = self.incoming.get(session)
        return max(pending) if pending else None

    def when_landed(self, session: int, version: int, then: Callable[[], None]) -> bool:
        """Run ``then`` once that version has landed; False (and nothing queued) if it has."""
        pending = self.incoming.get(session)
        if not pending or version not in pending:
            return False
        pending[version].append(then)
        return True

    def landed(self, session: int, version: int) -> None:
        """That version's KV is here: whatever waited for it goes on."""
        pending = self.incoming.get(session)
        if not pending or version not in pending:
            return
        waiters = pending.pop(version)
        if not pending:
            del self.incoming[session]
        for then in waiters:
            then()

    def cache_put(self, session: int, version: int, tokens: int) -> None:
        """Record that this MD holds the session's context at ``version`` (mutates the LRU)."""
        if self.holders is not None:
            held = self.holders.get(session)
            if held is None:
                self.holders[session] = {self.state.id: self}
            else:
                held[self.state.id] = self
        cache = self.cache
        old = cache.pop(session, None)
        if old is not None:
            self.cache_tokens -= old[1]
            if old[0] > version:
                version = old[0]  # an older turn finishing late must not regress it
        self.cache_tokens += tokens
        cache[session] = (version, tokens)
        while self.cache_tokens > self.cache_capacity and cache:
            _, (_, evicted) = cache.popitem(last=False)
            self.cache_tokens -= evicted
