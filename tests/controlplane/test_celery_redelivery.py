"""A task whose worker is killed mid-run is delivered again and completes once (acks_late, a
visibility timeout above the time limit, reject on worker lost)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from bench.celery_worker import ROOT, start_worker, stop_worker


@pytest.mark.redis
def test_a_task_of_a_killed_worker_is_redelivered_and_completes_once(tmp_path):
    import redis

    client = redis.Redis.from_url(os.environ["REDIS_URL"])
    queue = f"test-redeliver-{uuid.uuid4().hex[:8]}"
    key = f"test-ping-{uuid.uuid4().hex[:8]}"
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "controlplane.settings",
        "BATON_VAR_DIR": str(tmp_path),
        "CELERY_TASK_ALWAYS_EAGER": "false",
        # Short limits so the redelivery comes within seconds (the defaults: 90 s / 120 s).
        "CELERY_TASK_SOFT_TIME_LIMIT": "8",
        "CELERY_TASK_TIME_LIMIT": "10",
        "CELERY_VISIBILITY_TIMEOUT": "12",
    }
    first = start_worker(env, queue)
    second = None
    try:
        send = (
            "import django; django.setup();"
            "from controlplane.tasks import ping;"
            f"print(ping.apply_async(args=['again', 4.0, '{key}'], queue='{queue}').id)"
        )
        task_id = subprocess.run(
            [sys.executable, "-c", send], cwd=ROOT, env=env, capture_output=True, text=True,
            timeout=120, check=True,
        ).stdout.strip().splitlines()[-1]  # fmt: skip
        deadline = time.monotonic() + 90
        while client.get(f"{key}:started") is None:
            assert time.monotonic() < deadline, "the first worker never started the task"
            time.sleep(0.1)
        os.killpg(first.pid, signal.SIGKILL)  # mid-run: no ack was sent
        first.wait(30)
        assert client.get(f"{key}:done") is None
        second = start_worker(env, queue)
        wait = (
            "import django; django.setup();"
            "from celery.result import AsyncResult;"
            "from controlplane.celery import app;"
            f"print(AsyncResult('{task_id}', app=app).get(timeout=120))"
        )
        out = subprocess.run(
            [sys.executable, "-c", wait], cwd=ROOT, env=env, capture_output=True, text=True,
            timeout=180,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.strip().splitlines()[-1] == "again"
        time.sleep(1.0)
        assert int(client.get(f"{key}:started")) == 2  # delivered again after the kill
        assert int(client.get(f"{key}:done")) == 1  # and completed once
    finally:
        for worker in (first, second):
            stop_worker(worker)
        client.delete(f"{key}:started", f"{key}:done")
