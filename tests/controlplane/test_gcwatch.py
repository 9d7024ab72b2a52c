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


def test_thresholds_are_read_from_the_environment(monkeypatch):
    import pytest
    from django.core.exceptions import ImproperlyConfigured

    from base.env import env_int_list

    monkeypatch.delenv("BATON_GC_THRESHOLDS", raising=False)
    assert env_int_list("BATON_GC_THRESHOLDS", [50_000, 10, 10], count=3) == (50_000, 10, 10)
    monkeypatch.setenv("BATON_GC_THRESHOLDS", "")
    assert env_int_list("BATON_GC_THRESHOLDS", [50_000], count=3) == ()  # CPython's own
    monkeypatch.setenv("BATON_GC_THRESHOLDS", " 20000, 5 ")
    assert env_int_list("BATON_GC_THRESHOLDS", [], count=3) == (20_000, 5)
    for bad in ("fast", "1,2,3,4", "-1"):
        monkeypatch.setenv("BATON_GC_THRESHOLDS", bad)
        with pytest.raises(ImproperlyConfigured, match="BATON_GC_THRESHOLDS="):
            env_int_list("BATON_GC_THRESHOLDS", [], count=3)


def test_tune_sets_the_thresholds_and_freeze_moves_what_is_alive_out_of_reach():
    before = gc.get_threshold()
    try:
        gcwatch.tune((50_000, 10, 10))
        assert gc.get_threshold() == (50_000, 10, 10)
        gcwatch.tune(())  # empty: unchanged
        assert gc.get_threshold() == (50_000, 10, 10)
        kept = [[] for _ in range(100)]
        assert gcwatch.freeze() >= len(kept)
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
