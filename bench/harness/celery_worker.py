"""A real Celery worker process (Redis broker) for the tests and the chaos harness."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _worker(args: list[str], env: dict[str, str], out) -> subprocess.Popen:
    """``celery -A controlplane worker ARGS``, in its own session, its output to `out`."""
    return subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "controlplane", "worker", *args],
        cwd=ROOT,
        env=env,
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def start_worker(env: dict[str, str], queue: str) -> subprocess.Popen:
    """One solo-pool worker consuming only `queue`, in its own process group."""
    args = ["--pool=solo", "--concurrency=1", "-Q", queue, "--loglevel=WARNING",
            "--without-gossip", "--without-mingle", "--without-heartbeat"]  # fmt: skip
    return _worker(args, env, subprocess.DEVNULL)


def stop_worker(worker: subprocess.Popen | None) -> None:
    """SIGTERM, then SIGKILL after 20 s; nothing if it already ended."""
    if worker is None or worker.poll() is not None:
        return
    os.killpg(worker.pid, signal.SIGTERM)
    try:
        worker.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait(timeout=20)


def start_worker_with_beat(env: dict[str, str], tmp: str, log_path: Path) -> subprocess.Popen:
    """One worker with beat in it, in its own session (its pool and beat are its children)."""
    with open(log_path, "w") as log:
        args = ["-B", "-s", str(Path(tmp) / "beat-schedule"), "--loglevel=INFO"]
        return _worker(args, env, log)
