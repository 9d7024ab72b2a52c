"""The web process times its garbage collections and logs a long one (it stops the event
loop for as long)."""

from __future__ import annotations

import gc
import logging

from controlplane import gcwatch


def test_every_collection_is_timed_and_a_long_one_logged(caplog):
    gcwatch.install(warn_ms=1e-6)  # every collection counts as long here
    try:
        before = dict(gcwatch.stats)
        garbage = [[] for _ in range(1000)]
        for a, b in zip(garbage, garbage[1:], strict=False):
            a.append(b)
            b.append(a)  # cycles: only the collector frees them
        del garbage
        with caplog.at_level(logging.WARNING, logger="baton.gc"):
            gc.collect()
        assert gcwatch.stats["collections"] > before["collections"]
        assert gcwatch.stats["long"] > before["long"]
        assert gcwatch.stats["max_s"] > 0
        lines = [r.getMessage() for r in caplog.records if r.name == "baton.gc"]
        full = [x for x in lines if x.startswith("gc: generation 2 took ")]
        assert full and "objects collected" in full[-1], lines
    finally:
        gcwatch.install(warn_ms=0)  # counted, never logged


def test_installing_twice_adds_one_hook():
    gcwatch.install(warn_ms=50)
    gcwatch.install(warn_ms=50)
    assert gc.callbacks.count(gcwatch._on_gc) == 1
