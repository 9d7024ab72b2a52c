"""The ASGI app answers uvicorn's lifespan protocol and, on shutdown, waits for the request
records still being written."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import asyncio
import controlplane.asgi as entry
from routing.gateway import views

written = []

async def main():
    async def slow_write():
        await asyncio.sleep(0.3)
        written.append(1)

    task = asyncio.ensure_future(slow_write())
    views.pending_records.add(task)
    task.add_done_callback(views.pending_records.discard)
    inbox = asyncio.Queue()
    for kind in ("lifespan.startup", "lifespan.shutdown"):
        inbox.put_nowait({"type": kind})
    sent = []

    async def send(message):
        sent.append(message["type"])

    await entry.application({"type": "lifespan"}, inbox.get, send)
    print(sent, written)

asyncio.run(main())
"""


def run_probe(probe: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """``probe`` in a fresh interpreter on the embedded defaults (no PostgreSQL, no Redis)."""
    env = {k: v for k, v in os.environ.items() if k not in {"DATABASE_URL", "REDIS_URL"}}
    env.update(
        DJANGO_SETTINGS_MODULE="controlplane.settings",
        BATON_VAR_DIR=str(tmp_path),
        BATON_EMBEDDED_BEAT="false",
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done


def test_shutdown_waits_for_records_in_flight(tmp_path):
    done = run_probe(PROBE, tmp_path)
    assert done.stdout.strip().splitlines()[-1] == (
        "['lifespan.startup.complete', 'lifespan.shutdown.complete'] [1]"
    )


WARM_PROBE = """
import asyncio, sys
import controlplane.asgi as entry

async def main():
    inbox = asyncio.Queue()
    for kind in ("lifespan.startup", "lifespan.shutdown"):
        inbox.put_nowait({"type": kind})

    async def send(message):
        if message["type"] == "lifespan.startup.complete":
            loaded = [m in sys.modules for m in ("frontend.views", "fleet.api.agent")]
            print("views loaded:", *loaded)

    await entry.application({"type": "lifespan"}, inbox.get, send)

asyncio.run(main())
"""


def test_the_views_are_loaded_before_the_process_reports_started(tmp_path):
    """The start-up warm-up (controlplane/warmup.py): Django would import them on the first
    request it resolves."""
    done = run_probe(WARM_PROBE, tmp_path)
    assert "views loaded: True True" in done.stdout
    assert "warm-up: urls" in done.stderr  # the log line with each step's seconds
