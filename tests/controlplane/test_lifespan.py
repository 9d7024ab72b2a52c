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


def test_shutdown_waits_for_records_in_flight(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in {"DATABASE_URL", "REDIS_URL"}}
    env.update(
        DJANGO_SETTINGS_MODULE="controlplane.settings",
        BATON_VAR_DIR=str(tmp_path),
        BATON_EMBEDDED_BEAT="false",
    )
    done = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == (
        "['lifespan.startup.complete', 'lifespan.shutdown.complete'] [1]"
    )
