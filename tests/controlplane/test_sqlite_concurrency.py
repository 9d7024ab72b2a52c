"""The embedded SQLite database under concurrent writers (heartbeats, gateway records, logins
all write from different threads): transactions wait for the lock instead of failing with
"database is locked"."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import threading, django
django.setup()
from django.core.management import call_command
from django.db import connection, transaction
from fleet.models import Datacenter
call_command("migrate", verbosity=0)
errors = []
def writer(n):
    try:
        for i in range(25):
            with transaction.atomic():
                Datacenter.objects.filter(region="r").count()  # read first, then write
                Datacenter.objects.create(name=f"dc-{n}-{i}", region="r")
    except Exception as exc:
        errors.append(repr(exc))
    finally:
        connection.close()
threads = [threading.Thread(target=writer, args=(n,)) for n in range(8)]
[t.start() for t in threads]
[t.join() for t in threads]
print("ERRORS", len(errors), errors[:1])
print("ROWS", Datacenter.objects.count())
"""


def test_concurrent_read_then_write_transactions_all_commit(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in {"DATABASE_URL", "REDIS_URL"}}
    env |= {"DJANGO_SETTINGS_MODULE": "controlplane.settings", "BATON_VAR_DIR": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.strip().splitlines() if " " in line)
    assert lines["ERRORS"].startswith("0 "), lines["ERRORS"]
    assert lines["ROWS"] == "200"
