"""Where aggregation state lives: integer counters in per-second, per-minute and total buckets.

``LocalStore`` keeps them in this process (the embedded default, one web process).
``RedisStore`` keeps them in Redis hashes so every gateway and web process adds to and reads
the same state; each process buffers its increments and flushes them in one pipeline every
``flush_interval_s`` (a few hundred increments per flush whatever the request rate), and
caches buckets that can no longer change.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import TypeVar, cast

log = logging.getLogger(__name__)

SECOND = "s"
MINUTE = "m"
TOTAL = "t"
# Kept: an hour of seconds and a day of minutes, with a margin for windows that straddle.
RETAIN = {SECOND: 3600 + 120, MINUTE: 24 * 60 + 5}

Deltas = dict[tuple[str, int], dict[str, int]]
Bucket = dict[str, int]
K = TypeVar("K")


def merge_into(target: dict[K, int], delta: Mapping[K, int]) -> None:
    """Add ``delta``'s counts into ``target`` (a bucket's fields, or a histogram's bins)."""
    for field, value in delta.items():
        target[field] = target.get(field, 0) + value


class Store:
    """Counters by bucket. ``apply`` adds; ``set_values`` overwrites (gauges); reads copy."""

    def apply(self, deltas: Deltas) -> None:
        raise NotImplementedError

    def set_values(self, kind: str, key: int, values: dict[str, int]) -> None:
        raise NotImplementedError

    def read(self, kind: str, keys: Iterable[int], *, now: float) -> dict[int, Bucket]:
        raise NotImplementedError

    def read_total(self) -> Bucket:
        raise NotImplementedError

    def flush(self) -> None:
        """Push buffered increments to shared state (no-op where nothing is buffered)."""

    def clear(self) -> None:
        raise NotImplementedError


class LocalStore(Store):
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buckets: dict[str, dict[int, Bucket]] = {SECOND: {}, MINUTE: {}}
        self._total: Bucket = {}
        self._newest = {SECOND: 0, MINUTE: 0}

    def apply(self, deltas: Deltas) -> None:
        with self._lock:
            for (kind, key), delta in deltas.items():
                if kind == TOTAL:
                    merge_into(self._total, delta)
                    continue
                merge_into(self._buckets[kind].setdefault(key, {}), delta)
                if key > self._newest[kind]:
                    self._newest[kind] = key
                    self._prune(kind)

    def _prune(self, kind: str) -> None:
        buckets = self._buckets[kind]
        if len(buckets) <= RETAIN[kind]:
            return
        oldest_kept = self._newest[kind] - RETAIN[kind]
        for key in [k for k in buckets if k < oldest_kept]:
            del buckets[key]

    def set_values(self, kind: str, key: int, values: dict[str, int]) -> None:
        with self._lock:
            self._buckets[kind].setdefault(key, {}).update(values)

    def read(self, kind: str, keys: Iterable[int], *, now: float) -> dict[int, Bucket]:
        with self._lock:
            buckets = self._buckets[kind]
            return {k: dict(buckets[k]) for k in keys if k in buckets}

    def read_total(self) -> Bucket:
        with self._lock:
            return dict(self._total)

    def clear(self) -> None:
        with self._lock:
            self._buckets = {SECOND: {}, MINUTE: {}}
            self._total = {}


class RedisStore(Store):
    """Shared state in Redis hashes ``{prefix}:{kind}:{key}``; increments are buffered."""

    # A bucket is final once every process has flushed into it: its end plus this margin
    # (flush interval and clock skew between hosts).
    SETTLE_S = 3.0

    def __init__(self, url: str, *, prefix: str = "baton:tlm", flush_interval_s: float = 0.2):
        import redis

        self.client = redis.Redis.from_url(url)
        self.prefix = prefix
        self.flush_interval_s = flush_interval_s
        self._lock = threading.Lock()
        self._pending: Deltas = defaultdict(dict)
        self._cache: dict[tuple[str, int], Bucket] = {}
        self._flusher: threading.Thread | None = None
        self._stop = threading.Event()
        atexit.register(self.close)

    def _key(self, kind: str, key: int) -> str:
        return f"{self.prefix}:{kind}:{key}" if kind != TOTAL else f"{self.prefix}:{TOTAL}"

    def apply(self, deltas: Deltas) -> None:
        with self._lock:
            for bucket, delta in deltas.items():
                merge_into(self._pending[bucket], delta)
        self._ensure_flusher()

    def _ensure_flusher(self) -> None:
        if self._flusher is not None and self._flusher.is_alive():
            return
        with self._lock:
            if self._flusher is not None and self._flusher.is_alive():
                return
            self._stop.clear()
            self._flusher = threading.Thread(
                target=self._flush_loop, name="telemetry-redis-flush", daemon=True
            )
            self._flusher.start()

    def _flush_loop(self) -> None:
        while not self._stop.wait(self.flush_interval_s):
            try:
                self.flush()
            except Exception:  # Redis away: keep the buffer and retry on the next tick
                log.warning("telemetry flush to Redis failed", exc_info=True)

    def flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, defaultdict(dict)
        if not pending:
            return
        try:
            pipe = self.client.pipeline(transaction=False)
            for (kind, key), delta in pending.items():
                name = self._key(kind, key)
                for field, value in delta.items():
                    if value:
                        pipe.hincrby(name, field, value)
                if kind != TOTAL:
                    pipe.expire(name, RETAIN[kind] * _unit(kind))
            pipe.execute()
        except Exception:
            with self._lock:  # put it back so nothing is lost
                for bucket, delta in pending.items():
                    merge_into(self._pending[bucket], delta)
            raise

    def set_values(self, kind: str, key: int, values: dict[str, int]) -> None:
        name = self._key(kind, key)
        pipe = self.client.pipeline(transaction=False)
        pipe.hset(name, mapping=values)
        pipe.expire(name, RETAIN[kind] * _unit(kind))
        pipe.execute()

    def read(self, kind: str, keys: Iterable[int], *, now: float) -> dict[int, Bucket]:
        keys = list(keys)
        out: dict[int, Bucket] = {}
        missing: list[int] = []
        for key in keys:
            cached = self._cache.get((kind, key))
            if cached is not None:
                out[key] = cached
            else:
                missing.append(key)
        if missing:
            pipe = self.client.pipeline(transaction=False)
            for key in missing:
                pipe.hgetall(self._key(kind, key))
            for key, raw in zip(missing, pipe.execute(), strict=True):
                bucket = {f.decode(): int(v) for f, v in raw.items()}
                if bucket:
                    out[key] = bucket
                if (key + 1) * _unit(kind) + self.SETTLE_S < now:
                    self._cache[(kind, key)] = bucket
            self._prune_cache(kind, now)
        return out

    def _prune_cache(self, kind: str, now: float) -> None:
        oldest = int(now / _unit(kind)) - RETAIN[kind]
        for bucket in [b for b in self._cache if b[0] == kind and b[1] < oldest]:
            del self._cache[bucket]

    def read_total(self) -> Bucket:
        # redis-py types every reply as `Awaitable[T] | T`, one signature for its sync and
        # async clients; this client is the sync one, whose HGETALL answers a dict.
        raw = cast("dict[bytes, bytes]", self.client.hgetall(self._key(TOTAL, 0)))
        return {f.decode(): int(v) for f, v in raw.items()}

    def clear(self) -> None:
        with self._lock:
            self._pending = defaultdict(dict)
            self._cache = {}
        names = list(self.client.scan_iter(match=f"{self.prefix}:*", count=1000))
        for start in range(0, len(names), 500):
            self.client.delete(*names[start : start + 500])

    def close(self) -> None:
        self._stop.set()
        try:
            self.flush()
        except Exception:
            log.warning("final telemetry flush failed", exc_info=True)


def _unit(kind: str) -> int:
    return 60 if kind == MINUTE else 1


def now_s() -> float:
    return time.time()
