"""The Celery worker kill: a real worker process on the real Redis broker is SIGKILLed while it
runs a task; a second worker must get the task again (acks_late, reject on worker lost, a
visibility timeout above the time limit) and complete it once.

The task is `controlplane.tasks.ping` with a 4 s delay and a Redis counter of its starts and
completions, so "delivered again" and "applied once" are counted, not assumed. Limits are
shortened (time limit 10 s, visibility timeout 12 s) so the redelivery comes within seconds;
production's are 120 s and 150 s (docs/faults.md)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid

from bench.harness.celery_worker import ROOT, start_worker, stop_worker

TASK_DELAY_S = 4.0


def redis_url() -> str | None:
    """REDIS_URL, else the local default if a Redis answers there; None without one."""
    url = os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/0"
    try:
        import redis

        redis.Redis.from_url(url, socket_connect_timeout=2).ping()
    except Exception:  # noqa: BLE001 - no broker: the trial is not run (and the report says so)
        return None
    return url


def _python(code: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", "import django; django.setup();" + code],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def celery_worker_kill(url: str, rep: int) -> dict:
    import redis

    client = redis.Redis.from_url(url)
    queue = f"chaos-celery-{uuid.uuid4().hex[:8]}"
    key = f"chaos-ping-{uuid.uuid4().hex[:8]}"
    var_dir = tempfile.mkdtemp(prefix="baton-chaos-celery-")
    env = {
        **os.environ,
        "REDIS_URL": url,
        "DJANGO_SETTINGS_MODULE": "controlplane.settings",
        "BATON_VAR_DIR": var_dir,
        "CELERY_TASK_ALWAYS_EAGER": "false",
        "CELERY_TASK_SOFT_TIME_LIMIT": "8",
        "CELERY_TASK_TIME_LIMIT": "10",
        "CELERY_VISIBILITY_TIMEOUT": "12",
    }
    trial: dict = {"fault": "celery-worker-kill", "rep": rep, "queue": queue}
    first = start_worker(env, queue)
    second = None
    try:
        sent = _python(
            "from controlplane.tasks import ping;"
            f"print(ping.apply_async(args=['chaos-{rep}', {TASK_DELAY_S}, '{key}'],"
            f" queue='{queue}').id)",
            env,
            120,
        )
        if sent.returncode != 0:
            trial["error"] = f"could not send the task: {sent.stderr[-300:]}"
            return trial
        task_id = sent.stdout.strip().splitlines()[-1]
        deadline = time.monotonic() + 90
        while client.get(f"{key}:started") is None:
            if time.monotonic() > deadline:
                trial["error"] = "the first worker never started the task"
                return trial
            time.sleep(0.1)
        killed_at = time.monotonic()
        os.killpg(first.pid, signal.SIGKILL)  # mid-run: no ack was sent
        first.wait(30)
        trial["done_before_restart"] = int(client.get(f"{key}:done") or 0)
        second = start_worker(env, queue)
        got = _python(
            "from celery.result import AsyncResult; from controlplane.celery import app;"
            f"print(AsyncResult('{task_id}', app=app).get(timeout=150))",
            env,
            200,
        )
        trial["recovery_s"] = time.monotonic() - killed_at
        trial["result"] = got.stdout.strip().splitlines()[-1] if got.returncode == 0 else None
        if got.returncode != 0:
            trial["error"] = f"no result: {got.stderr[-300:]}"
        time.sleep(1.0)
        trial["deliveries"] = int(client.get(f"{key}:started") or 0)
        trial["completions"] = int(client.get(f"{key}:done") or 0)
        trial["ok"] = (
            trial.get("result") == f"chaos-{rep}"
            and trial["deliveries"] == 2
            and trial["completions"] == 1
            and trial["done_before_restart"] == 0
        )
        return trial
    finally:
        for worker in (first, second):
            stop_worker(worker)
        client.delete(f"{key}:started", f"{key}:done")
        shutil.rmtree(var_dir, ignore_errors=True)
