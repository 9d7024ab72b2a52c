"""The gateway counts what it routed since each instance's last report, so a burst of decisions
between two heartbeats does not herd onto the instance that looked least loaded."""

from __future__ import annotations

import os
import time
import uuid

import pytest

from pdd.policy import (
    ClusterSnapshot,
    InstanceState,
    PolicySettings,
    RequestInfo,
    Role,
    WanLinkState,
    decide,
)
from routing.dispatches import DispatchLedger, with_dispatches
from routing.live import LiveView


def view(report_at: float = 100.0) -> LiveView:
    states = [
        InstanceState("p1", Role.PREFILL, "dc-a", load=0.0),
        InstanceState("r1", Role.RELAY_DECODE, "dc-a", load=0.10),
        InstanceState("r2", Role.RELAY_DECODE, "dc-a", load=0.12),
        InstanceState("m1", Role.MAIN_DECODE, "dc-b", load=0.0),
    ]
    snapshot = ClusterSnapshot.from_instances(states, {"dc-b": WanLinkState(0.01, 30.0)})
    reported = {s.id: (report_at, 100.0) for s in states}
    return LiveView(snapshot=snapshot, reported=reported)


def test_dispatches_after_the_report_raise_the_load() -> None:
    ledger = DispatchLedger()
    ledger.record(["r1"], now=99.0)  # before the report: already in the agent's load
    ledger.record(["r1", "m1", None], now=101.0)
    ledger.record(["r1"], now=102.0)
    snap = with_dispatches(view(report_at=100.0), ledger)
    loads = {s.id: s.load for s in (*snap.prefill, *snap.relay_decode, *snap.main_decode)}
    assert loads["r1"] == 0.10 + 2 / 100
    assert loads["m1"] == 1 / 100
    assert loads["p1"] == 0.0 and loads["r2"] == 0.12


def test_the_cached_view_is_not_changed_and_nothing_new_returns_it() -> None:
    ledger = DispatchLedger()
    v = view()
    assert with_dispatches(v, ledger) is v.snapshot
    ledger.record(["r1"], now=200.0)
    with_dispatches(v, ledger)
    assert v.snapshot.relay_decode[0].load == 0.10


def test_a_burst_of_relayed_decisions_spreads_over_the_relays() -> None:
    ledger = DispatchLedger()
    v = view(report_at=0.0)  # every dispatch below is newer than the report
    # A 100K-token prompt over a 10 Mbit/s link: every request takes P-RLD-MD.
    request = RequestInfo(prompt_tokens=100_000, max_tokens=64)
    picked = []
    for _ in range(6):
        decision = decide(request, with_dispatches(v, ledger), PolicySettings())
        picked.append(decision.relay_id)
        ledger.record((decision.prefill_id, decision.relay_id, decision.main_id))
    # Without the ledger all six would go to r1 (0.10 < 0.12); with it the loads level out.
    assert picked.count("r2") >= 2
    final = with_dispatches(v, ledger).relay_decode
    assert abs(final[0].load - final[1].load) <= 0.01 + 1e-9


def test_old_dispatches_are_forgotten_and_unknown_instances_count_nothing() -> None:
    ledger = DispatchLedger(horizon_s=10.0)
    ledger.record(["r1"], now=0.0)
    ledger.record(["r1"], now=50.0)  # prunes the entry from t=0
    assert ledger.since("r1", -1.0) == 1
    assert ledger.since("nobody", 0.0) == 0
    ledger.clear()
    assert ledger.since("r1", -1.0) == 0


def test_a_ledger_whose_redis_is_unreachable_counts_its_own_dispatches(caplog) -> None:
    ledger = DispatchLedger(redis_url="redis://127.0.0.1:1/0")  # nothing listens on port 1
    assert ledger.shared
    ledger.record(["r1", "m1"], now=101.0)
    ledger.record(["r1"], now=102.0)
    assert ledger.since_many([("r1", 100.0), ("m1", 101.5), ("p1", 0.0)]) == {
        "r1": 2,
        "m1": 0,
        "p1": 0,
    }
    snap = with_dispatches(view(report_at=100.0), ledger)
    assert {s.id: s.load for s in snap.relay_decode}["r1"] == 0.10 + 2 / 100
    assert "counting this process's dispatches only" in caplog.text
    # After a failure it leaves Redis alone for a while instead of timing out on every request.
    assert not ledger._use_redis()


@pytest.mark.redis
def test_gateway_processes_share_the_ledger_through_redis() -> None:
    # Two ledgers on one Redis stand for two gateway worker processes.
    prefix = f"baton:test-dispatch:{uuid.uuid4().hex}"
    url = os.environ["REDIS_URL"]
    first = DispatchLedger(redis_url=url, prefix=prefix)
    second = DispatchLedger(redis_url=url, prefix=prefix)
    now = time.time()
    first.record(["r1", "m1"], now=now - 1.0)
    second.record(["r1", None], now=now)
    # Each sees the other's dispatches after the report time.
    for ledger in (first, second):
        assert ledger.since_many([("r1", now - 5.0), ("m1", now - 0.5), ("r2", 0.0)]) == {
            "r1": 2,
            "m1": 0,
            "r2": 0,
        }
    snap = with_dispatches(view(report_at=now - 5.0), second)
    loads = {s.id: s.load for s in (*snap.relay_decode, *snap.main_decode)}
    assert loads["r1"] == 0.10 + 2 / 100 and loads["m1"] == 1 / 100
    # Dispatches older than the horizon are dropped from Redis when the next one is recorded.
    short = DispatchLedger(horizon_s=1.0, redis_url=url, prefix=prefix)
    short.record(["m1"], now=now + 5.0)
    assert short.since("m1", 0.0) == 1
    for ledger in (first, second, short):
        ledger.clear()
    assert first.since_many([("r1", 0.0), ("m1", 0.0)]) == {"r1": 0, "m1": 0}
