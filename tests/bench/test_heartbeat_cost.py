"""bench/heartbeat_cost.py runs on a throwaway database and counts what a beat writes: a beat
that changes nothing is one write (the node's last_heartbeat_at), a changed one three."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_heartbeat_bench_counts_one_write_for_an_unchanged_beat(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in {"DATABASE_URL", "REDIS_URL"}}
    env["BATON_VAR_DIR"] = str(tmp_path)
    out = subprocess.run(
        [sys.executable, "bench/heartbeat_cost.py", "--nodes", "2", "--rounds", "2"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    result = json.loads(out.stdout)
    assert result["database"] == "sqlite"
    for via in ("service", "http"):
        assert result[f"{via}_unchanged"]["writes"] == 1
        assert result[f"{via}_changed"]["writes"] == 3
        assert result[f"{via}_unchanged"]["beats"] == 4
