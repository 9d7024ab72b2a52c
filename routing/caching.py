"""A small in-process cache whose entries are trusted for at most `max_age_s` (the gateway's
hot path: keys, models, the fleet's topology)."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

V = TypeVar("V")

MAX_AGE_S = 0.5  # seconds


class TtlCache(Generic[V]):
    def __init__(self, max_age_s: float = MAX_AGE_S, capacity: int = 10_000) -> None:
        self.max_age_s = max_age_s
        self.capacity = capacity
        self._entries: OrderedDict[Hashable, tuple[float, V]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable, load: Callable[[], V]) -> V:
        """The cached value for `key` if younger than max_age_s, else `load()` (stored)."""
        now = time.monotonic()
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None and now - hit[0] < self.max_age_s:
                self._entries.move_to_end(key)
                return hit[1]
        value = load()
        with self._lock:
            self._entries[key] = (now, value)
            self._entries.move_to_end(key)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
        return value

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)
