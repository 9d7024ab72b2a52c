"""Finding dead agents within about two heartbeat intervals, without waiting for traffic to hit
them.

A node goes offline after ``BATON_HEARTBEAT_MISSES`` silent heartbeat intervals (6 s by
default); a gateway that hits a dead instance marks it suspect at once, but only when a request
tries it. This probe runs every heartbeat interval (``routing.probe_agents``): it asks the agent
of each reporting node whose last heartbeat is late (``BATON_PROBE_AFTER_S``, 1.25 intervals by
default; 0: every node) for ``/health`` and marks the node's instances suspect (the gateway's
ledger, shared through Redis when set) when

- the connection is refused or reset: the agent process is gone (SIGKILL, a crash), or
- it does not answer within the probe timeout and its last heartbeat is more than one interval
  and a half old: the agent is frozen (SIGSTOP, a hung host) or its network is black-holed.

A slow answer from an agent whose heartbeats still arrive marks nothing, so a loaded but live
agent is not routed around. A suspect is cleared by the node's next report, as for a gateway's
own marks."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import httpx
from django.conf import settings

from fleet import live as fleet_live
from fleet.agent_client import health_answers
from routing.suspects import suspect_ledger

log = logging.getLogger(__name__)

DEAD = "dead"  # connection refused / reset
SILENT = "silent"  # no answer in time, heartbeat overdue
OK = "ok"


@dataclass(slots=True, frozen=True)
class ProbeResult:
    hostname: str
    endpoint: str
    verdict: str
    detail: str
    instance_ids: tuple[str, ...]


def _instance_ids(entry: dict[str, Any]) -> tuple[str, ...]:
    items = (entry.get("report") or {}).get("instances") or []
    return tuple(str(i["instance_id"]) for i in items if isinstance(i, dict) and "instance_id" in i)


def _verdict(answer: httpx.Response | httpx.HTTPError, entry: dict[str, Any], now: float,
             interval_s: float) -> ProbeResult:  # fmt: skip
    endpoint = str(entry.get("endpoint") or "").rstrip("/")
    hostname = str(entry.get("hostname") or entry.get("node_id"))
    ids = _instance_ids(entry)
    if isinstance(answer, httpx.Response):
        return ProbeResult(hostname, endpoint, OK, f"HTTP {answer.status_code}", ids)
    detail = f"{type(answer).__name__}: {answer}"
    if isinstance(answer, (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError)):
        return ProbeResult(hostname, endpoint, DEAD, detail, ids)
    if isinstance(answer, httpx.TimeoutException):
        overdue = now - float(entry.get("received_at") or 0.0) > 1.5 * interval_s
        verdict = SILENT if overdue else OK
        return ProbeResult(hostname, endpoint, verdict, f"no answer ({type(answer).__name__})", ids)
    return ProbeResult(hostname, endpoint, OK, detail, ids)


def probe_agents(*, timeout_s: float | None = None) -> list[ProbeResult]:
    """Probe, concurrently, every node with a fresh report whose last heartbeat is late (older
    than BATON_PROBE_AFTER_S); mark the instances of dead or silent ones suspect. Returns each
    probed node's result. A node whose beats arrive on time is alive: asking it too cost 500
    requests a second at 1,000 nodes (bench/control_path)."""
    interval_s = float(settings.BATON_HEARTBEAT_INTERVAL_S)
    timeout_s = min(1.0, interval_s / 2) if timeout_s is None else timeout_s
    after_s = settings.BATON_PROBE_AFTER_S
    after_s = 1.25 * interval_s if after_s is None else float(after_s)
    now = time.time()
    entries = [
        e
        for e in fleet_live.read_reports()
        if e.get("endpoint") and now - float(e.get("received_at") or 0.0) >= after_s
    ]
    if not entries:
        return []
    # Each probe connects only to an address the endpoint policy checked (fleet.pinning): a
    # refused or unresolvable endpoint is a ConnectError before any connection, so "dead".
    answers = health_answers([str(e["endpoint"]) for e in entries], timeout_s)
    results = [_verdict(a, e, now, interval_s) for a, e in zip(answers, entries, strict=True)]
    ledger = suspect_ledger()
    for result in results:
        if result.verdict != OK and result.instance_ids:
            ledger.mark(result.instance_ids)
            log.warning(
                "agent of node %s (%s) is %s: %s; its instances %s are routed around",
                result.hostname, result.endpoint, result.verdict, result.detail,
                ", ".join(result.instance_ids),
            )  # fmt: skip
    return results
