"""The agent probe finds a dead or frozen agent within one heartbeat interval, before any
request hits it, and leaves a slow agent whose heartbeats still arrive alone."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from fleet import live as fleet_live
from routing.probes import DEAD, OK, SILENT, probe_agents
from routing.suspects import suspect_ledger


class _Health(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - the http.server hook
        payload = b'{"status": "ok"}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


@pytest.fixture
def agents(settings):
    """Four nodes' reports: a live agent, a dead one (nothing listens), and two that accept
    connections but never answer (frozen), one with its heartbeat overdue."""
    settings.REDIS_URL = ""
    settings.BATON_HEARTBEAT_INTERVAL_S = 2.0
    settings.BATON_PROBE_AFTER_S = 0  # every node, late or not (the default: late ones only)
    fleet_live._memory.clear()
    live = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=live.serve_forever, daemon=True).start()
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    dead_port = dead.getsockname()[1]
    dead.close()  # nothing listens there
    frozen = socket.socket()
    frozen.bind(("127.0.0.1", 0))
    frozen.listen(8)  # the kernel completes the handshake; nobody reads
    ports = {
        "live": live.server_address[1],
        "dead": dead_port,
        "frozen-overdue": frozen.getsockname()[1],
        "frozen-fresh": frozen.getsockname()[1],
    }
    for i, (host, port) in enumerate(ports.items(), start=1):
        fleet_live.publish_report(
            node_id=i,
            hostname=host,
            datacenter="dc-a",
            endpoint=f"http://127.0.0.1:{port}",
            report={"instances": [{"instance_id": str(10 + i), "role": "prefill"}]},
        )
    # The overdue one last reported 3.5 s ago (more than 1.5 intervals).
    entry = json.loads(fleet_live._memory["3"])
    entry["received_at"] = time.time() - 3.5
    fleet_live._memory["3"] = json.dumps(entry)
    yield
    live.shutdown()
    frozen.close()
    fleet_live._memory.clear()


def test_dead_and_frozen_agents_are_marked_suspect_and_a_live_one_is_not(agents):
    verdicts = {r.hostname: r.verdict for r in probe_agents(timeout_s=0.3)}
    assert verdicts == {
        "live": OK,
        "dead": DEAD,
        "frozen-overdue": SILENT,
        "frozen-fresh": OK,  # its heartbeats still arrive: slow, not dead
    }
    assert set(suspect_ledger().marks()) == {"12", "13"}


def test_by_default_only_agents_whose_heartbeat_is_late_are_asked(agents, settings):
    settings.BATON_PROBE_AFTER_S = None  # 1.25 intervals: 2.5 s
    verdicts = {r.hostname: r.verdict for r in probe_agents(timeout_s=0.3)}
    assert verdicts == {"frozen-overdue": SILENT}  # the others beat on time: not asked
    assert set(suspect_ledger().marks()) == {"13"}


def test_no_reports_means_nothing_to_probe(settings):
    settings.REDIS_URL = ""
    fleet_live._memory.clear()
    assert probe_agents() == []


def test_the_api_lists_what_is_routed_around(agents, operator, viewer, anonymous):
    probe_agents(timeout_s=0.3)
    listed = viewer.get("/api/v1/suspect-instances/")
    assert listed.status_code == 200
    rows = {row["instance"]: row for row in listed.json()}
    assert set(rows) == {"12", "13"}
    assert all(row["routed_around"] for row in rows.values())
    # The dead node reports again: still listed for the minute, no longer routed around.
    fleet_live.publish_report(
        node_id=2,
        hostname="dead",
        datacenter="dc-a",
        endpoint="http://127.0.0.1:1",
        report={"instances": [{"instance_id": "12", "role": "prefill"}]},
    )
    rows = {row["instance"]: row for row in viewer.get("/api/v1/suspect-instances/").json()}
    assert rows["12"]["routed_around"] is False and rows["13"]["routed_around"] is True
    assert anonymous.get("/api/v1/suspect-instances/").status_code in (401, 403)
