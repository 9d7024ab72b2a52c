"""The web process's start-up warm-up (controlplane/warmup.py): each step timed, a failing
step does not stop the start (that the views are loaded before uvicorn hears the process
started: test_lifespan.py)."""

from __future__ import annotations

import logging

import pytest

from controlplane import warmup


def test_each_step_is_timed_and_a_failure_only_logged(monkeypatch, caplog):
    calls = []
    monkeypatch.setattr(warmup, "_urls", lambda: calls.append("urls"))

    def broken() -> None:
        raise ConnectionError("redis down")

    monkeypatch.setattr(warmup, "_prefix_index", broken)
    with caplog.at_level(logging.INFO, logger="controlplane.warmup"):
        took = warmup.warm_up()
    assert calls == ["urls"]
    assert set(took) == {"urls", "prefix_index"} and all(v >= 0 for v in took.values())
    assert "prefix_index failed; it will be loaded on first use" in caplog.text


@pytest.mark.django_db
def test_without_redis_the_index_step_is_a_no_op(settings):
    settings.REDIS_URL = ""
    assert warmup.warm_up()["prefix_index"] < 1.0
