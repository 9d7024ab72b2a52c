"""bench/control_path.py end to end on something small: 3 probe nodes for a few seconds against
the embedded control plane (SQLite, the web process's own beat, no Celery). Asserts what
happened, never how fast: the machine running the suite may be loaded."""

from __future__ import annotations

import json

import pytest

from bench import control_path

pytestmark = pytest.mark.slow


def test_the_probe_registers_heartbeats_and_is_counted(tmp_path):
    result = control_path.run_one(
        3, seconds=6, blocks=10, out=tmp_path, production=False, bring_up_timeout_s=120
    )

    bring_up = result["bring_up"]
    assert bring_up["registrations"].get("ok", 0) >= 3
    # The two main decoders (3 // 2 = 1 node in bench-a, the rest in bench-b) posted their KV
    # snapshots and the index took them.
    assert bring_up["kv_snapshots"] == {"ok": 2}

    window = result["window"]
    beats = window["heartbeats"]
    assert beats["sent"] >= 3  # each node beats at least once in 6 s
    # Every beat of the window is accounted for: answered 2xx or an error of a named kind.
    assert beats["answered_2xx"] + beats["error_total"] == beats["sent"]
    assert beats["answered_2xx"] >= 3
    assert beats["rtt_p50_ms"] is not None and beats["rtt_max_ms"] >= beats["rtt_p50_ms"]
    assert window["still_in_flight_after_timeout"] == 0
    assert isinstance(window["node_offline_events"], int)
    assert set(window["cpu_cores"]) == {"uvicorn", "probe"}
    assert window["uvicorn_rss_mb"] > 0
    # The operator pages, each fetched 5 times and answered (the fleet page by a session).
    for name, page in window["pages"].items():
        assert page["fetches"] == 5 and page["all_200"], name

    probe = result["probe"]
    assert probe["heartbeats_total"]["answered_2xx"] >= beats["answered_2xx"]
    # The control plane's beat reached the probe's endpoints (health probes, reconcile).
    assert sum(probe["served_to_control_plane"].values()) > 0
    assert set(result["goals"]) >= {"heartbeat_p99_le_100ms", "pages_fast", "all_met"}
    assert json.loads((tmp_path / "result.json").read_text())["nodes"] == 3
