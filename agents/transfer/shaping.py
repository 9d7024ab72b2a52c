"""Sender-side shaping of one link: a shared bandwidth budget, RTT latency and a connection pool.

Model (also in README.md):
- Bandwidth: one virtual clock per link. A quantum of q bytes occupies the link for q / rate
  seconds; quanta are granted one at a time, round-robin over the transfers waiting for one, so
  concurrent transfers share the rate fairly and a small transfer passes a large one.
- Bound: over any window of T seconds the link grants at most rate * T + burst_allowance_bytes,
  where the allowance is one quantum plus rate * catch_up (the virtual clock may run up to
  catch_up behind real time, to make up for late timer wake-ups instead of losing rate). A
  sender writes its quantum as soon as it is granted, so the same bound holds for bytes on the
  wire over windows longer than the event loop's scheduling delay.
- RTT: opening a connection costs one RTT (`LinkLease.handshake`); a transfer's completion is
  visible rtt / 2 after its last byte leaves (`LinkLease.propagate`).
- Pool: at most pool_size transfers hold a connection; the rest wait, and that wait is measured.
Settings can be changed on a running shaper and apply from the next quantum / acquisition.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections import deque
from dataclasses import dataclass
from types import TracebackType
from typing import NamedTuple

from agents.transfer.pool import LinkPool, PoolStats
from pdd.checks import check_int, check_number

MIN_QUANTUM_BYTES = 512
MAX_QUANTUM_BYTES = 16 * 1024 * 1024


@dataclass(slots=True)
class LinkSettings:
    """Shape of one link. Bandwidth in Gbit/s (10**9 bit/s), RTT in milliseconds."""

    bandwidth_gbps: float
    rtt_ms: float
    pool_size: int
    quantum_bytes: int = 32 * 1024
    catch_up_ms: float = 5.0

    def __post_init__(self) -> None:
        check_number(self.bandwidth_gbps, "bandwidth_gbps", gt=0)
        check_number(self.rtt_ms, "rtt_ms", ge=0)
        check_int(self.pool_size, "pool_size", ge=1)
        if not MIN_QUANTUM_BYTES <= self.quantum_bytes <= MAX_QUANTUM_BYTES:
            raise ValueError(
                f"quantum_bytes must be in [{MIN_QUANTUM_BYTES}, {MAX_QUANTUM_BYTES}], "
                f"got {self.quantum_bytes}"
            )
        check_number(self.catch_up_ms, "catch_up_ms", ge=0)

    @property
    def bytes_per_s(self) -> float:
        return self.bandwidth_gbps * 1e9 / 8

    @property
    def rtt_s(self) -> float:
        return self.rtt_ms / 1000

    @property
    def burst_allowance_bytes(self) -> int:
        """Most bytes the link may grant beyond bytes_per_s * window, for any window."""
        return self.quantum_bytes + math.ceil(self.bytes_per_s * self.catch_up_ms / 1000)


class LinkBudget:
    """The link's virtual clock: when may the next quantum start, given real time `now`.

    Pure bookkeeping (no sleeping), so its guarantees can be tested without a clock.
    """

    def __init__(self, bytes_per_s: float, catch_up_s: float) -> None:
        self._bytes_per_s = bytes_per_s
        self._catch_up_s = catch_up_s
        self._last_start: float | None = None
        self._last_bytes = 0
        self._free_at = -math.inf

    def start_time(self, now: float) -> float:
        """Earliest start of the next quantum; a quantum may be granted once this is <= now."""
        if self._free_at < now - self._catch_up_s:
            # The link went idle (or fell far behind): idle time is not banked as credit.
            return now
        return self._free_at

    def commit(self, start: float, nbytes: int) -> None:
        """Record a quantum of `nbytes` granted at virtual time `start`."""
        self._last_start = start
        self._last_bytes = nbytes
        self._free_at = start + nbytes / self._bytes_per_s

    def set_rate(self, bytes_per_s: float) -> None:
        """Change the rate; the quantum in flight is re-timed at the new rate."""
        self._bytes_per_s = bytes_per_s
        if self._last_start is not None:
            self._free_at = self._last_start + self._last_bytes / bytes_per_s

    def set_catch_up(self, catch_up_s: float) -> None:
        self._catch_up_s = catch_up_s


class ShaperStats(NamedTuple):
    """Counters of one shaper since creation (pool integrals since the pool's last reset)."""

    bytes_granted: int
    quanta_granted: int
    waiting_for_quantum: int
    pool: PoolStats


class LinkShaper:
    """Shapes every transfer over one link. Use one shaper per link, from one event loop.

    Typical use (this is what FabricClient does)::

        async with shaper.lease() as lease:      # waits for a pooled connection
            await lease.handshake()              # one RTT of connection setup
            while remaining:
                n = await lease.grant(remaining) # a fair share of the link, <= one quantum
                ...write n bytes...
            await lease.propagate()              # the last byte lands rtt / 2 later
    """

    def __init__(self, settings: LinkSettings) -> None:
        self._settings = dataclasses.replace(settings)
        self._pool = LinkPool(settings.pool_size)
        self._budget = LinkBudget(settings.bytes_per_s, settings.catch_up_ms / 1000)
        self._queue: deque[tuple[asyncio.Future[int], int]] = deque()
        self._dispatcher: asyncio.Task[None] | None = None
        self._wakeup: asyncio.Future[None] | None = None
        self.bytes_granted = 0
        self.quanta_granted = 0

    @property
    def settings(self) -> LinkSettings:
        """A copy of the current settings (change them with `update`)."""
        return dataclasses.replace(self._settings)

    @property
    def pool(self) -> LinkPool:
        return self._pool

    def stats(self) -> ShaperStats:
        return ShaperStats(
            bytes_granted=self.bytes_granted,
            quanta_granted=self.quanta_granted,
            waiting_for_quantum=sum(1 for fut, _ in self._queue if not fut.done()),
            pool=self._pool.stats(),
        )

    def update(
        self,
        *,
        bandwidth_gbps: float | None = None,
        rtt_ms: float | None = None,
        pool_size: int | None = None,
        quantum_bytes: int | None = None,
        catch_up_ms: float | None = None,
    ) -> LinkSettings:
        """Change settings on the running link; returns the new settings.

        Bandwidth re-times the quantum in flight and paces every later one; RTT applies to
        handshakes and propagation that start afterwards; a bigger pool admits waiters at once,
        a smaller one admits nobody until enough holders release. Call from the shaper's event
        loop (from another thread: `loop.call_soon_threadsafe(functools.partial(...))`).
        """
        old = self._settings
        new = dataclasses.replace(  # validates
            old,
            bandwidth_gbps=old.bandwidth_gbps if bandwidth_gbps is None else bandwidth_gbps,
            rtt_ms=old.rtt_ms if rtt_ms is None else rtt_ms,
            pool_size=old.pool_size if pool_size is None else pool_size,
            quantum_bytes=old.quantum_bytes if quantum_bytes is None else quantum_bytes,
            catch_up_ms=old.catch_up_ms if catch_up_ms is None else catch_up_ms,
        )
        self._settings = new
        self._budget.set_rate(new.bytes_per_s)
        self._budget.set_catch_up(new.catch_up_ms / 1000)
        self._pool.resize(new.pool_size)
        if self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)  # the dispatcher recomputes its deadline
        return self.settings

    def lease(self, *, background: bool = False) -> LinkLease:
        """A connection slot on this link, as an async context manager; ``background`` queues
        behind every urgent transfer for the slot (see agents/transfer/pool.py)."""
        return LinkLease(self, background=background)

    async def grant(self, want: int) -> int:
        """Wait for this transfer's turn on the link; returns how many bytes (1..quantum) it may
        write now. Cancelling the wait gives the turn to the next transfer."""
        if want <= 0:
            raise ValueError(f"want must be > 0, got {want}")
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._queue.append((future, want))
        if self._dispatcher is None:
            self._dispatcher = asyncio.get_running_loop().create_task(self._dispatch())
        return await future

    async def _dispatch(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self._queue:
                future, want = self._queue[0]
                if future.done():  # its transfer was cancelled
                    self._queue.popleft()
                    continue
                now = time.monotonic()
                start = self._budget.start_time(now)
                if start > now:
                    await self._sleep(loop, start - now)
                    continue  # settings or the head of the queue may have changed
                self._queue.popleft()
                granted = min(want, self._settings.quantum_bytes)
                self._budget.commit(start, granted)
                self.bytes_granted += granted
                self.quanta_granted += 1
                future.set_result(granted)
        finally:
            self._dispatcher = None

    async def _sleep(self, loop: asyncio.AbstractEventLoop, delay: float) -> None:
        # A timer future rather than asyncio.sleep, so `update` can wake the dispatcher early.
        wakeup: asyncio.Future[None] = loop.create_future()
        self._wakeup = wakeup
        timer = loop.call_later(delay, _resolve, wakeup)
        try:
            await wakeup
        finally:
            timer.cancel()
            self._wakeup = None


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class LinkLease:
    """One transfer's hold on a pooled connection of a shaped link."""

    def __init__(self, shaper: LinkShaper, *, background: bool = False) -> None:
        self._shaper = shaper
        self._background = background
        self._held = False
        self.wait_for_connection_s = 0.0

    async def __aenter__(self) -> LinkLease:
        self.wait_for_connection_s = await self._shaper.pool.acquire(background=self._background)
        self._held = True
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._held:
            self._held = False
            self._shaper.pool.release()

    async def handshake(self) -> None:
        """Connection setup: one RTT before the first byte may leave."""
        await asyncio.sleep(self._shaper.settings.rtt_s)

    async def grant(self, want: int) -> int:
        """This transfer's next share of the link's bandwidth (see LinkShaper.grant)."""
        if not self._held:
            raise RuntimeError("grant() outside `async with shaper.lease()`")
        return await self._shaper.grant(want)

    async def propagate(self) -> None:
        """One-way latency: the last byte is seen by the receiver rtt / 2 after it left."""
        await asyncio.sleep(self._shaper.settings.rtt_s / 2)
