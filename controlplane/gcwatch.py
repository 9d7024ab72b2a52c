"""The web process's garbage collector: tuned for a busy event loop, and its long pauses logged.

A collection holds the GIL for as long as it takes, so the event loop (the heartbeats' fast
path, the gateway's streams) stops for it. At 1,000 nodes (500 heartbeats a second) CPython's
defaults ran a young collection every 700 allocations, so a request's objects, alive for a few
milliseconds across awaits, were promoted before they died; a full collection then followed
every 2-7 s and took 70-270 ms each (bench/control_path/REPORT.md). So, in the web process:

- ``tune``: the young generation's threshold raised (``BATON_GC_THRESHOLDS``, default 50,000:
  a young collection scans at most that many objects, about a millisecond, and a request's
  objects die before it), and ``gc.freeze()`` once start-up is done (``BATON_GC_FREEZE``):
  the modules, URL patterns and settings loaded at start-up are never scanned again;
- ``install``: a ``gc.callbacks`` hook times every collection, counts them in ``stats`` and
  logs a warning for one of at least ``BATON_GC_WARN_MS``."""

from __future__ import annotations

import gc
import logging
import sys
import time

log = logging.getLogger("baton.gc")

stats: dict[str, float] = {"collections": 0, "long": 0, "total_s": 0.0, "max_s": 0.0}
_started = 0.0
_warn_s = 0.05


def _on_gc(phase: str, info: dict) -> None:
    global _started
    if phase == "start":
        _started = time.perf_counter()
        return
    took = time.perf_counter() - _started
    stats["collections"] += 1
    stats["total_s"] += took
    stats["max_s"] = max(stats["max_s"], took)
    if took >= _warn_s:
        stats["long"] += 1
        if sys.is_finalizing():  # the collections at exit: the log's streams may be closed
            return
        log.warning(
            "gc: generation %d took %.0f ms (%d objects collected, %d uncollectable)",
            info.get("generation", -1),
            took * 1000,
            info.get("collected", 0),
            info.get("uncollectable", 0),
        )


def install(warn_ms: float) -> None:
    """Time every collection from now on; warn about one of at least `warn_ms` (0: never)."""
    global _warn_s
    _warn_s = warn_ms / 1000.0 if warn_ms > 0 else float("inf")
    if _on_gc not in gc.callbacks:
        gc.callbacks.append(_on_gc)


def tune(thresholds: tuple[int, ...]) -> None:
    """Set the collector's thresholds (``gc.set_threshold``); empty: keep CPython's."""
    if thresholds:
        gc.set_threshold(*thresholds)


def freeze() -> int:
    """Move every object alive now out of the collector's reach (start-up done); how many."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
