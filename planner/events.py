"""A minimal discrete-event loop: a heap of (time, sequence, callback, args)."""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any


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

    def run(self, until: float = float("inf")) -> None:
        heap = self._heap
        pop = heapq.heappop
        while heap and heap[0][0] <= until:
            time, _, callback, args = pop(heap)
            self.now = time
            callback(*args)
        if until != float("inf"):
            self.now = max(self.now, until)
