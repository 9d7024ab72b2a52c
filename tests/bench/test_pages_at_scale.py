"""bench.pages_at_scale declares N nodes with heartbeats and times /metrics and the fleet page;
here at N = 4, in a subprocess (it sets up Django on a database of its own)."""

from __future__ import annotations

import json
import subprocess
import sys

from bench.harness.testbed import ROOT


def test_it_times_both_pages_at_n_nodes():
    out = subprocess.run(
        [sys.executable, "-m", "bench.pages_at_scale", "--nodes", "4", "--fetches", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
    assert [x["page"] for x in lines] == ["/metrics", "/fleet/"]
    for x in lines:
        assert x["nodes"] == 4 and len(x["seconds"]) == 2
        assert all(s > 0 for s in x["seconds"])


def test_bad_counts_exit_2_with_a_message():
    out = subprocess.run(
        [sys.executable, "-m", "bench.pages_at_scale", "--nodes", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "--nodes" in out.stderr
