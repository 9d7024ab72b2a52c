"""The web process's garbage-collection pauses, logged when long.

A collection holds the GIL for as long as it takes, so the event loop (the heartbeats' fast
path, the gateway's streams) stops for it; a full collection over a thousand nodes' reports
and live-view entries can take longer than a heartbeat may. ``install`` (controlplane/asgi.py)
adds a ``gc.callbacks`` hook that times every collection, counts them per generation in
``stats`` and logs a warning for one of at least ``BATON_GC_WARN_MS``."""

from __future__ import annotations

import gc
import logging
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
