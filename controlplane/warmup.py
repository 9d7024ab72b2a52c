"""First-use work a web process does at start-up instead of on its first requests.

Django loads the URL configuration (and with it every view module) on the first request it
resolves, and this process's mirror of the prefix index (fleet/kv_index.py) reads every decode
instance's cached blocks from Redis on its first sync. At a thousand nodes those two took
~0.45 s and ~0.55 s of the first /metrics scrape's ~1 s in an idle process (3-5x that under
500 heartbeats a second, bench/control_path/REPORT.md), while a later scrape only catches the
mirror up with the events since. Both are done once here, before uvicorn reports the process
started (and before start-up's objects are frozen out of garbage collection); a failure is
logged and the process starts anyway, paying the cost on first use as before.
"""

from __future__ import annotations

import logging
import time

from django.urls import get_resolver

from fleet.kv_index import prefix_index

log = logging.getLogger(__name__)


def warm_up() -> dict[str, float]:
    """Load the URL configuration and the prefix index mirror; seconds each took."""
    took: dict[str, float] = {}
    for name, step in (("urls", _urls), ("prefix_index", _prefix_index)):
        start = time.perf_counter()
        try:
            step()
        except Exception:  # noqa: BLE001 - a cold first request, not a failed start
            log.exception("warm-up: %s failed; it will be loaded on first use", name)
        took[name] = round(time.perf_counter() - start, 3)
    log.info("warm-up: %s", ", ".join(f"{k} {v:.3f} s" for k, v in took.items()))
    return took


def _urls() -> None:
    get_resolver().url_patterns  # noqa: B018 - the property imports every URLconf and view


def _prefix_index() -> None:
    prefix_index().sync()  # a no-op without Redis (the index is this process's own)
