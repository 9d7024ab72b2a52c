"""In-process caches for the gateway's hot path (keys, models, the fleet's rows): `TtlCache`
trusts an entry for at most `max_age_s`; `shared_cache` ones stay until the data's change
counter moves (`CacheVersions`), which every process reads at most every half second."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

from django.core.exceptions import SynchronousOnlyOperation
from django.db import transaction
from django.db.models import F

from routing.models import CacheVersion

V = TypeVar("V")
log = logging.getLogger(__name__)

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


# -- caches shared data invalidates across processes ------------------------------------------

CHECK_EVERY_S = 0.5  # how often a process reads the counters (at most; on use)
SAFETY_MAX_AGE_S = 30.0  # a change no save announced (a queryset update, SQL) lands by then


class CacheVersions:
    """Per-name change counters in the database (``routing.CacheVersion``), read at most every
    CHECK_EVERY_S by whichever request comes first, so a process keeps its cached keys, models
    and fleet rows for as long as nothing changed instead of reloading them on a timer: at one
    request every few hundred milliseconds a plain time-to-live cache missed on every other
    request. A save or delete through the ORM bumps the counter when its transaction commits
    (``bump``, connected by signals), so every process sees the change within CHECK_EVERY_S
    of its commit, and this process at once."""

    def __init__(self, check_every_s: float = CHECK_EVERY_S) -> None:
        self.check_every_s = check_every_s
        self._caches: dict[str, list[TtlCache]] = {}
        self._seen: dict[str, int] = {}
        self._checked_at = -math.inf
        self._lock = threading.Lock()
        self._refresher: threading.Thread | None = None
        self._hooks: list[Callable[[], None]] = []

    def register(self, name: str, cache: TtlCache) -> TtlCache:
        self._caches.setdefault(name, []).append(cache)
        return cache

    def _clear(self, name: str) -> None:
        for cache in self._caches.get(name, ()):
            cache.clear()

    def check(self) -> None:
        """Read the counters if nobody did for CHECK_EVERY_S (twice that while the refresher
        runs: it reads them, a request reads them only if it fell behind)."""
        now = time.monotonic()
        period = self.check_every_s * (2 if self._refresher_alive() else 1)
        with self._lock:
            if now - self._checked_at < period:
                return
            before, self._checked_at = self._checked_at, now  # one reader per period
        try:
            self._read()
        except SynchronousOnlyOperation:
            # Called on the event loop (the gateway's inline path): the read is a worker's.
            with self._lock:
                self._checked_at = before
            raise

    def _refresher_alive(self) -> bool:
        thread = self._refresher
        return thread is not None and thread.is_alive()

    def on_refresh(self, hook: Callable[[], None]) -> None:
        """Also call `hook` on the refresher's thread every period (another cached read that
        requests should not wait for)."""
        self._hooks.append(hook)

    def start_refresher(self) -> threading.Event:
        """Read the counters every CHECK_EVERY_S on a thread of their own (a serving process's
        start-up), so that no request waits for the read; returns the event that stops it."""
        from django.db import close_old_connections

        stop = threading.Event()

        def run() -> None:
            while not stop.is_set():
                close_old_connections()
                with self._lock:
                    self._checked_at = time.monotonic()
                self._read()
                for hook in self._hooks:
                    try:
                        hook()
                    except Exception:  # noqa: BLE001 - the request path reads it then
                        log.warning("cache refresh hook %r failed", hook, exc_info=True)
                stop.wait(self.check_every_s)
            close_old_connections()

        self._refresher = threading.Thread(target=run, name="cache-versions", daemon=True)
        self._refresher.start()
        return stop

    def _read(self) -> None:
        try:
            found = dict(CacheVersion.objects.values_list("name", "version"))
        except SynchronousOnlyOperation:
            raise
        except Exception:  # noqa: BLE001 - cannot tell what changed: trust nothing cached
            log.warning("cache versions unreadable; emptying the gateway caches", exc_info=True)
            for name in self._caches:
                self._clear(name)
            return
        for name in self._caches:
            version = found.get(name, 0)
            with self._lock:
                moved = self._seen.get(name) != version
                self._seen[name] = version
            if moved:
                self._clear(name)

    def bump(self, name: str) -> None:
        """Note a change of `name`'s data: this process's caches of it are emptied now, and its
        counter moves once the transaction commits (once per transaction, whatever it saved),
        in a statement of its own. Moved inside the transaction, the counter's row was locked
        until the commit: every registration and state change of a thousand nodes queued on
        that one row (the control-path benchmark's first N = 1,000 bring-up). Other processes
        read the counter after the data is committed, so they never keep the old data."""
        self._clear(name)
        connection = transaction.get_connection()
        if connection.in_atomic_block and any(
            getattr(entry[1], "bumps", None) == name for entry in connection.run_on_commit
        ):
            return  # this transaction bumps `name` already (a rollback drops both)

        def move() -> None:
            if not CacheVersion.objects.filter(name=name).update(version=F("version") + 1):
                CacheVersion.objects.get_or_create(name=name, defaults={"version": 1})
            self._clear(name)  # what this process read meanwhile may predate the commit

        move.bumps = name  # type: ignore[attr-defined]
        transaction.on_commit(move)

    def reset(self) -> None:
        """Forget what was seen (tests: a new database)."""
        with self._lock:
            self._seen.clear()
            self._checked_at = -math.inf
        for name in self._caches:
            self._clear(name)


versions = CacheVersions()


def shared_cache(name: str, capacity: int = 10_000) -> TtlCache:
    """A cache of `name`'s data, emptied when its version moves (and every SAFETY_MAX_AGE_S);
    `get` checks the versions first."""
    return versions.register(name, VersionedCache(capacity=capacity))


class VersionedCache(TtlCache):
    def __init__(self, capacity: int = 10_000) -> None:
        super().__init__(max_age_s=SAFETY_MAX_AGE_S, capacity=capacity)

    def get(self, key, load):
        versions.check()
        return super().get(key, load)
