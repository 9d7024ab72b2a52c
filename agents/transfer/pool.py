"""A resizable connection pool for one link, with wait and utilisation accounting.

It behaves like an asyncio semaphore whose capacity can grow or shrink while tasks wait.
Waiters are served first come, first served within two classes: *urgent* transfers (a user's
first token waits on them) and *background* ones (the KV of a request the relay is already
answering, which MD needs only for the later handoff and its prefix cache). A background waiter
gets a slot only while no urgent one is queued, so heavy relayed transfers cannot hold up the
light P-MD ones behind them. Holders are never pre-empted.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from typing import NamedTuple


class PoolStats(NamedTuple):
    """A snapshot of a pool; the *_s fields are integrals since creation (or the last reset)."""

    capacity: int
    in_use: int
    waiting: int
    peak_in_use: int
    acquisitions: int
    background_acquisitions: int  # of them, acquisitions that queued as background
    total_wait_s: float  # summed over acquisitions that had to queue
    busy_slot_s: float  # integral of in_use over time: slot-seconds held
    full_s: float  # time during which every slot was taken
    elapsed_s: float

    @property
    def utilisation(self) -> float:
        """Mean fraction of the (current) capacity held over the elapsed time."""
        if self.elapsed_s <= 0:
            return 0.0
        return self.busy_slot_s / (self.capacity * self.elapsed_s)


class LinkPool:
    """Bounded pool of connection slots; urgent waiters first, each class in arrival order.

    Shrinking never takes a slot away from its holder: the pool simply admits nobody until
    in_use drops below the new capacity. Must be used from a single event loop.
    """

    def __init__(self, capacity: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._check_capacity(capacity)
        self._capacity = capacity
        self._clock = clock
        self._in_use = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._background: deque[asyncio.Future[None]] = deque()
        self.reset_stats()

    @staticmethod
    def _check_capacity(capacity: int) -> None:
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"pool capacity must be an int >= 1, got {capacity!r}")

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def in_use(self) -> int:
        return self._in_use

    @property
    def waiting(self) -> int:
        """Live waiters of both classes."""
        return sum(1 for w in (*self._waiters, *self._background) if not w.done())

    @property
    def waiting_background(self) -> int:
        return sum(1 for waiter in self._background if not waiter.done())

    def reset_stats(self) -> None:
        """Restart the integrals and peak (capacity and current holders are kept)."""
        self._started_at = self._last_change = self._clock()
        self._busy_slot_s = 0.0
        self._full_s = 0.0
        self._total_wait_s = 0.0
        self._acquisitions = 0
        self._background_acquisitions = 0
        self._peak_in_use = self._in_use

    def stats(self) -> PoolStats:
        self._integrate()
        return PoolStats(
            capacity=self._capacity,
            in_use=self._in_use,
            waiting=self.waiting,
            peak_in_use=self._peak_in_use,
            acquisitions=self._acquisitions,
            background_acquisitions=self._background_acquisitions,
            total_wait_s=self._total_wait_s,
            busy_slot_s=self._busy_slot_s,
            full_s=self._full_s,
            elapsed_s=self._last_change - self._started_at,
        )

    def resize(self, capacity: int) -> None:
        """Change the capacity; growing admits waiters at once, shrinking takes effect as
        holders release."""
        self._check_capacity(capacity)
        self._integrate()
        self._capacity = capacity
        self._admit_waiters()

    async def acquire(self, *, background: bool = False) -> float:
        """Take a slot, waiting if none is free; returns the seconds waited.

        An urgent acquire queues ahead of every background one; within a class, first come
        first served. Cancelling a waiting acquire leaves the pool exactly as before.
        """
        if background:
            self._background_acquisitions += 1
        queue = self._background if background else self._waiters
        ahead = self._waiters if not background else (*self._waiters, *self._background)
        if self._in_use < self._capacity and not any(not w.done() for w in ahead):
            self._take_slot()
            return 0.0
        started = self._clock()
        waiter = asyncio.get_running_loop().create_future()
        queue.append(waiter)
        # Entries ahead of us may be cancelled waiters that have not cleaned up yet.
        self._admit_waiters()
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                # The slot was handed over just before the cancel landed: give it back.
                self.release()
            elif waiter in queue:
                queue.remove(waiter)
                self._admit_waiters()
            raise
        waited = self._clock() - started
        self._total_wait_s += waited
        return waited

    def release(self) -> None:
        """Return a slot taken by `acquire`."""
        if self._in_use <= 0:
            raise RuntimeError("release() without a matching acquire()")
        self._integrate()
        self._in_use -= 1
        self._admit_waiters()

    def _take_slot(self) -> None:
        self._integrate()
        self._in_use += 1
        self._acquisitions += 1
        self._peak_in_use = max(self._peak_in_use, self._in_use)

    def _admit_waiters(self) -> None:
        while (self._waiters or self._background) and self._in_use < self._capacity:
            waiter = (self._waiters or self._background).popleft()
            if waiter.done():  # cancelled while queued
                continue
            self._take_slot()
            waiter.set_result(None)

    def _integrate(self) -> None:
        now = self._clock()
        span = now - self._last_change
        if span > 0:
            self._busy_slot_s += self._in_use * span
            if self._in_use >= self._capacity:
                self._full_s += span
        self._last_change = now
