"""Every process kind registers the periodic tasks at start-up, not when a task is first sent."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PERIODIC = ("fleet.health_check", "fleet.reconcile_fleet")


@pytest.mark.parametrize(
    "entry",
    [
        "import controlplane.asgi",  # the web process (uvicorn)
        "import controlplane.wsgi",
        "import django; django.setup()",  # manage.py, a worker, beat
    ],
)
def test_the_periodic_tasks_are_registered_once_django_is_set_up(entry, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in {"DATABASE_URL", "REDIS_URL"}}
    env.update(
        DJANGO_SETTINGS_MODULE="controlplane.settings",
        BATON_VAR_DIR=str(tmp_path),
        BATON_EMBEDDED_BEAT="false",
    )
    probe = (
        f"{entry}\nfrom controlplane.celery import app\n"
        f"print(all(name in app.tasks for name in {PERIODIC!r}))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "True"
