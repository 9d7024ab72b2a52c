"""A WAN link: bandwidth shared fairly among concurrent transfers, RTT, a bounded pool.

Fair sharing is processor sharing with a per-connection cap (a TCP stream over a long RTT is
window-limited, rate <= window / RTT): every active transfer gets min(cap, bandwidth / active).
Because all active transfers progress at the same rate, the link tracks one "attained bytes"
clock and a heap of finish marks, so each arrival or departure costs O(log n) instead of
touching every transfer.
A transfer that finds all pool connections busy waits FIFO for one; a *background* transfer
(nobody waits on it for a first token: its request is already being answered by the relay)
waits in a second FIFO that is served only when no urgent transfer is queued.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from mypy_extensions import mypyc_attr

from pdd.kv_formats import KV_FORMATS, PROFILE_KV_DTYPE, wire_factor
from pdd.spec import check_int, check_non_negative, check_positive
from planner.events import EventLoop

Done = Callable[[float, float], None]  # (transfer seconds incl. pool wait, pool wait seconds)


@mypyc_attr(native_class=False)  # checked fields (planner/native.py)
@dataclass(slots=True)
class WanLinkSpec:
    bandwidth_gbps: float = 20.0
    rtt_ms: float = 20.0
    per_connection_gbps: float = 0.225
    pool_size: int = 64
    # When set, one TCP connection moves at most a window per round trip: the per-connection
    # rate is window / RTT (overriding per_connection_gbps), so a longer RTT slows each transfer
    # while the line share (bandwidth / active transfers) is unchanged.
    tcp_window_kb: float | None = None
    # Fixed work per KV transfer at its two ends, off the wire (the sender's export, the
    # receiver's import): the KV lands this much after its last byte. 0: none.
    handoff_ms: float = 0.0
    # How the routing policy learns the link's use. 0: at once (every active transfer's share
    # of the line, the moment it decides). > 0: as the live system learns it, from the
    # sending agents' heartbeats every this many seconds: the bytes the link carried over the
    # last whole interval over what the line could carry in it, refreshed at each interval's
    # end (an agent's report of ``utilisation``, agents/node/agent.py).
    report_interval_s: float = 0.0
    # The format P sends KV in across this link ("": the engines' own; pdd/kv_formats.py), as
    # the live link's ``kv_format``: its bytes per token relative to the model profile's.
    kv_format: str = ""

    def __post_init__(self) -> None:
        for name in ("bandwidth_gbps", "rtt_ms", "per_connection_gbps"):
            check_positive(self, name)
        if self.kv_format and self.kv_format not in KV_FORMATS:
            raise ValueError(
                f"kv_format: must be empty or one of {', '.join(KV_FORMATS)}, "
                f"got {self.kv_format!r}"
            )
        check_int(self, "pool_size", 1)
        check_non_negative(self, "handoff_ms")
        check_non_negative(self, "report_interval_s")
        if self.tcp_window_kb is not None:
            check_positive(self, "tcp_window_kb")

    @property
    def wire_factor(self) -> float:
        """Bytes on the wire per byte of the profile's KV (its kv_bytes_per_token)."""
        return wire_factor(self.kv_format, PROFILE_KV_DTYPE)

    @property
    def pool_ceiling_gbps(self) -> float:
        """The most the pool can move at once: every connection at its own cap."""
        return self.pool_size * self.connection_gbps

    @property
    def effective_gbps(self) -> float:
        """What the link can carry: the line or the pool's ceiling, whichever is lower."""
        return min(self.bandwidth_gbps, self.pool_ceiling_gbps)

    def ceiling_warning(self) -> str | None:
        """A sentence when the pool, not the line, bounds the link (more bandwidth is then a
        no-op unless the pool or the per-connection rate rises too); None otherwise."""
        ceiling = self.pool_ceiling_gbps
        if ceiling >= self.bandwidth_gbps * (1 - 1e-9):
            return None
        need = int(-(-self.bandwidth_gbps // self.connection_gbps))
        return (
            f"pool ceiling {self.pool_size} connections x {self.connection_gbps:.3g} Gbit/s = "
            f"{ceiling:.3g} Gbit/s is below the line's {self.bandwidth_gbps:g} Gbit/s: the "
            f"link carries at most {ceiling:.3g} Gbit/s, and bandwidth above that changes "
            f"nothing unless pool_size rises too (>= {need} connections fill the line)"
        )

    def describe(self) -> dict[str, object]:
        """The link's limits as reported beside a run's figures."""
        return {
            "bandwidth_gbps": self.bandwidth_gbps,
            "connection_gbps": self.connection_gbps,
            "pool_size": self.pool_size,
            "pool_ceiling_gbps": self.pool_ceiling_gbps,
            "effective_gbps": self.effective_gbps,
            "bound_by": "pool" if self.ceiling_warning() else "line",
            "warning": self.ceiling_warning(),
        }

    @property
    def connection_gbps(self) -> float:
        """What one connection reaches alone: window / RTT, else per_connection_gbps."""
        if self.tcp_window_kb is None:
            return self.per_connection_gbps
        return self.tcp_window_kb * 1e3 * 8 / (self.rtt_ms / 1e3) / 1e9


class WanLink:
    def __init__(self, spec: WanLinkSpec, loop: EventLoop) -> None:
        self.spec = spec
        self.loop = loop
        self.capacity = spec.bandwidth_gbps * 1e9 / 8  # bytes/s
        self.cap = spec.connection_gbps * 1e9 / 8
        self.rtt = spec.rtt_ms / 1000.0
        self.pool_size = spec.pool_size
        self.attained = 0.0  # bytes every active transfer has received since the link began
        self.last = 0.0
        self.active: list[tuple[float, int, float, float, Done]] = []  # finish mark heap
        self.waiting: deque[tuple[float, float, Done]] = deque()
        self.background: deque[tuple[float, float, Done]] = deque()
        self.version = 0
        self._seq = 0
        # Statistics, integrated over time.
        self.bytes_sent = 0.0
        self.transfers = 0  # transfers started (bytes_sent / transfers is the mean size)
        self.pool_busy_integral = 0.0
        self.waits: list[float] = []
        # The reported use (spec.report_interval_s > 0): bytes carried so far (as of
        # _carried_at), at the last report, and the last report's utilisation.
        self.report_s = spec.report_interval_s
        self.next_report = self.report_s if self.report_s > 0 else float("inf")
        self.carried = 0.0
        self._carried_at = 0.0
        self._carried_mark = 0.0
        self.reported = 0.0

    # --- state the policy reads ---------------------------------------------------------------
    @property
    def rate(self) -> float:
        n = len(self.active)
        return min(self.cap, self.capacity / n) if n else self.cap

    @property
    def utilisation(self) -> float:
        n = len(self.active)
        return min(n * min(self.cap, self.capacity / n) / self.capacity, 1.0) if n else 0.0

    @property
    def pool_utilisation(self) -> float:
        return len(self.active) / self.pool_size

    def reported_utilisation(self) -> float:
        """The link's use as its last report gave it (``spec.report_interval_s``): what the
        policy sees in the live system. 0 until the first report."""
        self._carry(self.loop.now)
        return self.reported

    def _carry(self, now: float) -> None:
        """Count the bytes carried up to ``now`` at the current rates, closing every report
        interval that ended on the way. Called before the set of active transfers changes."""
        n = len(self.active)
        flow = min(self.cap * n, self.capacity) if n else 0.0  # bytes/s over all transfers
        t = self._carried_at
        while now >= self.next_report:
            end = self.next_report
            self.carried += flow * (end - t)
            t = end
            used = (self.carried - self._carried_mark) / (self.report_s * self.capacity)
            self.reported = used if used < 1.0 else 1.0
            self._carried_mark = self.carried
            self.next_report = end + self.report_s
        self.carried += flow * (now - t)
        self._carried_at = now

    def expected_wait_s(self) -> float:
        """Expected seconds a transfer sent now would wait for a pool connection.

        0 while a connection is free. With the pool full, the new transfer starts after the
        ``q`` queued ahead of it and then itself have each taken a connection, i.e. after q + 1
        departures. In steady state the pool completes transfers at its byte rate (every
        connection at the current per-transfer rate) divided by the mean transfer size, so
        the wait is (q + 1) x mean size / (pool size x per-transfer rate): queued transfers
        times the mean transfer time, over the pool size. The mean size is that of every
        transfer started on this link so far (no constant to choose).
        """
        if len(self.active) < self.pool_size:
            return 0.0
        mean_bytes = self.bytes_sent / self.transfers if self.transfers else 0.0
        # Background transfers queue behind every urgent one, so they do not delay it.
        return (len(self.waiting) + 1) * mean_bytes / (self.pool_size * self.rate)

    # --- transfers ------------------------------------------------------------------------------
    def send(self, nbytes: float, done: Done, background: bool = False) -> None:
        """Start (or queue for a connection) a transfer of ``nbytes``; ``done`` fires on arrival.

        ``background``: queue behind every urgent transfer (see the module docstring).
        """
        # _advance, _start and _reschedule, written out: this runs for every transfer.
        loop = self.loop
        now = loop.now
        if self.report_s:
            self._carry(now)
        active = self.active
        n = len(active)
        if n:
            rate = self.capacity / n
            if self.cap < rate:
                rate = self.cap
            self.attained += rate * (now - self.last)
            self.pool_busy_integral += n / self.pool_size * (now - self.last)
        self.last = now
        if n < self.pool_size:
            self._seq += 1
            heapq.heappush(active, (self.attained + nbytes, self._seq, now - 0.0, 0.0, done))
            self.bytes_sent += nbytes
            self.transfers += 1
        else:
            (self.background if background else self.waiting).append((now, nbytes, done))
        self.version = version = self.version + 1
        if active:
            remaining = active[0][0] - self.attained
            if remaining < 0.0:
                remaining = 0.0
            rate = self.capacity / len(active)
            if self.cap < rate:
                rate = self.cap
            loop._seq += 1  # loop.at, inline (the time is never in the past)
            heapq.heappush(
                loop._heap, (now + remaining / rate, loop._seq, self._on_finish, (version,))
            )

    def _start(self, start: float, nbytes: float, done: Done, wait: float) -> None:
        self._seq += 1
        heapq.heappush(self.active, (self.attained + nbytes, self._seq, start - wait, wait, done))
        self.bytes_sent += nbytes
        self.transfers += 1

    def totals(self) -> tuple[float, float]:
        """(connection-seconds of pool use over pool size, bytes sent) up to now."""
        self._advance()
        return self.pool_busy_integral, self.bytes_sent

    def _advance(self) -> None:
        now = self.loop.now
        n = len(self.active)
        if n:
            rate = self.capacity / n
            if self.cap < rate:
                rate = self.cap
            self.attained += rate * (now - self.last)
            self.pool_busy_integral += n / self.pool_size * (now - self.last)
        self.last = now

    def _reschedule(self) -> None:
        self.version += 1
        active = self.active
        if active:
            remaining = active[0][0] - self.attained
            if remaining < 0.0:
                remaining = 0.0
            rate = self.capacity / len(active)
            if self.cap < rate:
                rate = self.cap
            loop = self.loop
            loop.at(loop.now + remaining / rate, self._on_finish, self.version)

    def _on_finish(self, version: int) -> None:
        if version != self.version:
            return  # superseded by a later arrival or departure
        self._advance()
        now = self.loop.now
        if self.report_s:
            self._carry(now)
        active = self.active
        finished = []
        # A relative tolerance absorbs float drift in the attained-bytes clock.
        limit = self.attained * (1 + 1e-12) + 1e-3
        while active and active[0][0] <= limit:
            finished.append(heapq.heappop(active))
        waiting, background = self.waiting, self.background
        while (waiting or background) and len(active) < self.pool_size:
            queued_at, nbytes, done = (waiting or background).popleft()
            self._start(now, nbytes, done, now - queued_at)
        self._reschedule()
        at = self.loop.at
        for _, _, enqueued, wait, done in finished:
            # The last byte lands half an RTT later and the receiver's ack/notify takes the
            # other half, so the sender learns of completion one RTT after the data drains.
            self.waits.append(wait)
            at(now + self.rtt, done, now + self.rtt - enqueued, wait)
