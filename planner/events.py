"""A minimal discrete-event loop: a heap of (time, sequence, callback, args).

A run may also take a *stream*: events known before it starts, in time order, that would
otherwise all sit in the heap from the start (a trace's arrivals). The stream is merged with
the heap instead, an event of the stream going first on a tie in time, which is the order the
heap gives them when they are scheduled before every other event: same order, a heap of the
events in flight (hundreds) instead of the whole trace (hundreds of thousands).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from typing import Any

INF = float("inf")


class EventLoop:
    __slots__ = ("now", "_heap", "_seq")

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = 0  # ties break by scheduling order, which keeps runs deterministic

    def at(self, time: float, callback: Callable[..., None], *args: Any) -> None:
        assert time >= self.now - 1e-9, f"event scheduled in the past: {time} < {self.now}"
        self._seq += 1
        heapq.heappush(self._heap, (time, self._seq, callback, args))

    def run(
        self,
        until: float = INF,
        stream: tuple[Sequence[float], Sequence[Any], Callable[[Any], None]] | None = None,
    ) -> None:
        """Run events up to ``until``; ``stream`` = (times, args, callback): ``callback(arg)``
        at each time (non-decreasing), ahead of any heap event at the same time."""
        heap = self._heap
        pop = heapq.heappop
        if stream is not None:
            times, args, callback = stream
            k, m = 0, len(times)
            while k < m:
                t = times[k]
                if t > until:
                    break
                # Heap events strictly before the stream's next one; on a tie the stream goes.
                while heap and heap[0][0] < t:
                    time, _, cb, a = pop(heap)
                    self.now = time
                    cb(*a)
                self.now = t
                callback(args[k])
                k += 1
        while heap and heap[0][0] <= until:
            time, _, callback, a = pop(heap)
            self.now = time
            callback(*a)
        if until != INF:
            self.now = max(self.now, until)
