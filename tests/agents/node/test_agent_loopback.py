"""`python -m agents loopback --md-datacenter dc-a`: MD in P's datacenter, so P ships the KV over
the intra-DC fabric and nothing crosses the WAN (bench/pdd/calibrate.py's plain handoff)."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def _loopback(*extra: str) -> dict:
    argv = [sys.executable, "-m", "agents", "loopback", "--prompt-len", "96", "--max-tokens",
            "2", "--threads", "1", "--json", *extra]  # fmt: skip
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def test_md_in_p_datacenter_gets_the_kv_over_the_intra_dc_fabric() -> None:
    local = _loopback("--pipeline", "p-md", "--md-datacenter", "dc-a")
    assert local["error"] is None
    assert local["kv_bytes"]["wan"] == 0 and local["kv_bytes"]["intra_dc"] > 0
    assert local["tokens_by_role"]["md"] == 1
    assert local["kv_wait_s"] > 0
    remote = _loopback("--pipeline", "p-md")  # the default: MD behind the WAN in dc-b
    assert remote["kv_bytes"]["intra_dc"] == 0 and remote["kv_bytes"]["wan"] > 0
    assert remote["output_token_ids"] == local["output_token_ids"]


def test_a_bad_md_datacenter_is_refused_naming_the_flag() -> None:
    argv = [sys.executable, "-m", "agents", "loopback", "--md-datacenter", "dc-z"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "--md-datacenter" in done.stderr
