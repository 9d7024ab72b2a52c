"""The web process's start-up warm-up (controlplane/warmup.py): the URLconf and the prefix
index's mirror are loaded before the first request, and a failing step does not stop the
start."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from controlplane import warmup

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import asyncio, sys
import controlplane.asgi as entry

async def main():
    inbox = asyncio.Queue()
    for kind in ("lifespan.startup", "lifespan.shutdown"):
        inbox.put_nowait({"type": kind})
    sent = []

    async def send(message):
        sent.append(message["type"])
        if message["type"] == "lifespan.startup.complete":
            loaded = [m in sys.modules for m in ("frontend.views", "fleet.api.agent")]
            print("views loaded:", *loaded)

    await entry.application({"type": "lifespan"}, inbox.get, send)

asyncio.run(main())
"""


def test_the_views_are_loaded_before_the_process_reports_started(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in {"DATABASE_URL", "REDIS_URL"}}
    env.update(
        DJANGO_SETTINGS_MODULE="controlplane.settings",
        BATON_VAR_DIR=str(tmp_path),
        BATON_EMBEDDED_BEAT="false",
    )
    done = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "views loaded: True True" in done.stdout
    assert "warm-up: urls" in done.stderr  # the log line with each step's seconds


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
