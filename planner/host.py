"""Engines sharing one machine's cores: the live testbed, where every engine is a one-thread
CPU process and the gateway runs beside them (``fleet.host``; off by default).

The rule (processor sharing): at any moment each *busy* task on the host progresses at
``min(1, cores / busy tasks)`` of its own speed, so its work is stretched by
``max(1, busy tasks / cores)``. The tasks are every engine instance of the fleet, busy while
it computes (a prefill instance while a pass runs, a decode instance while it has a running
request), and, when ``request_cpu_s`` > 0, one more task for the gateway: each request the
fleet receives adds that many CPU seconds to the gateway's work, done under the same sharing.
The gateway's work takes cores from the engines; it does not delay the request it is for
(most of it is the answer's relay and its record, after the first token).

A task whose speed changes mid-way keeps the work it has done: a prefill pass's remaining
work, and a decode instance's token clock, continue at the new speed. The instances on a host
are :class:`HostedPrefill` and :class:`HostedDecode`; a fleet without a host runs the plain
instances, untouched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from mypy_extensions import mypyc_attr

from pdd.hardware import EngineSpec, GpuType, ModelSpec
from pdd.policy import InstanceState
from pdd.spec import check_positive, check_range
from planner.events import EventLoop
from planner.instances import DecodeInstance, PrefillInstance


@mypyc_attr(native_class=False)  # checked fields (planner/native.py)
@dataclass(slots=True)
class HostSpec:
    """Every instance of the fleet runs on one machine of ``cores`` cores."""

    cores: float
    # CPU seconds each request the fleet receives costs on the host outside the engines (the
    # gateway); 0 = none.
    request_cpu_s: float = 0.0

    def __post_init__(self) -> None:
        check_positive(self, "cores")
        check_range(self, "request_cpu_s", 0.0, 10.0)


class HostTask(Protocol):
    def rerate(self, rate: float) -> None:
        """Continue the work in progress at ``rate`` of full speed from now."""


class Host:
    """The shared machine: which tasks are busy, the speed each gets, CPU seconds per task."""

    def __init__(self, spec: HostSpec, loop: EventLoop) -> None:
        self.cores = float(spec.cores)
        self.loop = loop
        self.rate = 1.0  # the speed of every busy task, of its own full speed
        self.busy = 0
        self._tasks: list[HostTask] = []
        self._names: list[str] = []
        self._is_busy: list[bool] = []
        self._cpu_s: list[float] = []
        self._last = 0.0

    def add(self, task: HostTask, name: str) -> int:
        """Register a task; returns its index for :meth:`enter` and :meth:`leave`."""
        self._tasks.append(task)
        self._names.append(name)
        self._is_busy.append(False)
        self._cpu_s.append(0.0)
        return len(self._tasks) - 1

    def enter(self, idx: int) -> None:
        """Task ``idx`` starts computing; it reads its speed from :attr:`rate` afterwards."""
        self._account()
        self._is_busy[idx] = True
        self.busy += 1
        self._rerate(idx)

    def leave(self, idx: int) -> None:
        """Task ``idx`` has nothing to compute."""
        self._account()
        self._is_busy[idx] = False
        self.busy -= 1
        self._rerate(idx)

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds each task has used so far (wall time busy x its speed)."""
        self._account()
        return dict(zip(self._names, self._cpu_s, strict=True))

    def _account(self) -> None:
        now = self.loop.now
        dt = now - self._last
        if dt > 0.0 and self.busy:
            used = dt * self.rate
            for i, busy in enumerate(self._is_busy):
                if busy:
                    self._cpu_s[i] += used
        self._last = now

    def _rerate(self, changed: int) -> None:
        rate = min(1.0, self.cores / self.busy) if self.busy else 1.0
        if rate == self.rate:
            return
        self.rate = rate
        for i, task in enumerate(self._tasks):
            if self._is_busy[i] and i != changed:
                task.rerate(rate)


class HostWork:
    """CPU work on the host outside the engines (the gateway's per-request cost): a queue of
    seconds done at the host's shared speed."""

    def __init__(self, host: Host, name: str) -> None:
        self.host = host
        self.loop = host.loop
        self.idx = host.add(self, name)
        self.busy = False
        self.left = 0.0
        self._since = 0.0
        self._rate = 1.0
        self._version = 0

    def add(self, seconds: float) -> None:
        now = self.loop.now
        if self.busy:
            self.left -= (now - self._since) * self._rate
        else:
            self.busy = True
            self.left = 0.0
            self.host.enter(self.idx)
            self._rate = self.host.rate
        self.left += seconds
        self._since = now
        self._schedule()

    def rerate(self, rate: float) -> None:
        now = self.loop.now
        self.left -= (now - self._since) * self._rate
        self._since = now
        self._rate = rate
        self._schedule()

    def _schedule(self) -> None:
        self._version += 1
        left = self.left if self.left > 0.0 else 0.0
        self.loop.at(self.loop.now + left / self._rate, self._done, self._version)

    def _done(self, version: int) -> None:
        if version != self._version:
            return  # the speed or the work changed since this was scheduled
        self.busy = False
        self.left = 0.0
        self.host.leave(self.idx)


class HostedPrefill(PrefillInstance):
    """A prefill instance on a shared host: a pass is work (its seconds at full speed) done at
    the host's speed, busy from its first pass until its queue is empty."""

    # Parameters spelled out, not forwarded as *args: compiled (planner/native.py), a native
    # __init__ reached through super() with *args would receive the tuple as one argument.
    def __init__(
        self,
        state: InstanceState,
        gpu: GpuType,
        model: ModelSpec,
        engine: EngineSpec,
        loop: EventLoop,
        *,
        host: Host,
    ) -> None:
        super().__init__(state, gpu, model, engine, loop)
        self.host = host
        self.host_idx = host.add(self, self.state.id)
        self.host_busy = False
        self._pass: list = []  # [work left, since, speed, finished, tokens]
        self._pass_version = 0

    def _begin_pass(self, seconds: float, finished: list, tokens: int) -> None:
        if not self.host_busy:
            self.host_busy = True
            self.host.enter(self.host_idx)
        rate = self.host.rate
        now = self.loop.now
        self._pass = [seconds, now, rate, finished, tokens]
        self._pass_version += 1
        self.loop.at(now + seconds / rate, self._pass_end, self._pass_version)

    def rerate(self, rate: float) -> None:
        """The host's speed changed during a pass: its work left continues at ``rate``."""
        work, since, old, finished, tokens = self._pass
        now = self.loop.now
        work -= (now - since) * old
        if work < 0.0:
            work = 0.0
        self._pass = [work, now, rate, finished, tokens]
        self._pass_version += 1
        self.loop.at(now + work / rate, self._pass_end, self._pass_version)

    def _pass_end(self, version: int) -> None:
        if version != self._pass_version:
            return  # rescheduled at another speed since
        _, _, _, finished, tokens = self._pass
        self._finish_batch(finished, tokens)

    def _finish_batch(self, finished: list, tokens: int) -> None:
        super()._finish_batch(finished, tokens)
        if self.host_busy and not self.busy:  # no next pass started
            self.host_busy = False
            self.host.leave(self.host_idx)


class HostedDecode(DecodeInstance):
    """A decode instance on a shared host: busy while it has a running request, its steps
    stretched by 1 / the host's speed (its fixed and per-byte step costs both scaled)."""

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
        *,
        host: Host,
    ) -> None:
        super().__init__(
            state, gpu, model, engine, loop, kv_capacity_tokens, cache_capacity_tokens, holders
        )
        self.host = host
        self.host_idx = host.add(self, self.state.id)
        self.host_busy = False
        self._full_speed = (self._overhead_s, self._bytes_per_s)

    def _stretch(self, factor: float) -> None:
        overhead, per_s = self._full_speed
        self._overhead_s = overhead * factor
        self._bytes_per_s = per_s / factor

    def _start(self, ctx_tokens: int, start) -> None:
        if not self.host_busy:
            self.host_busy = True
            self.host.enter(self.host_idx)
            self._stretch(1.0 / self.host.rate)  # the step computed next is at the host's speed
        super()._start(ctx_tokens, start)

    def release(self, ctx_tokens: int) -> None:
        super().release(ctx_tokens)
        if self.host_busy and not self.running:
            self.host_busy = False
            self._stretch(1.0)
            self.host.leave(self.host_idx)
            self.step = self.step_time()
            self._reschedule()

    def rerate(self, rate: float) -> None:
        """The host's speed changed while this instance decodes: steps at ``rate`` of full speed
        from now (the token clock keeps what it has counted)."""
        self._advance()
        self._stretch(1.0 / rate)
        self.step = self.step_time()
        self._reschedule()
