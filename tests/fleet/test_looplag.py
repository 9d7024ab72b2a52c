"""A web process whose event loop runs late takes every node's heartbeats that much later; the
live view allows a report the live TTL plus that delay, so a saturated gateway process does not
take its own lateness for a fleet gone silent (pdd/looplag.py)."""

from __future__ import annotations

import asyncio
import time

import pytest

from fleet import live
from pdd import looplag


@pytest.fixture(autouse=True)
def _clean(settings, monkeypatch):
    settings.REDIS_URL = ""  # this process's reports (the rule is the same with Redis)
    monkeypatch.setattr(live, "_memory", {})
    looplag.clear()
    yield
    looplag.clear()


def _publish_aged(monkeypatch, node_id: int, age_s: float) -> None:
    real = time.time
    monkeypatch.setattr(live.time, "time", lambda: real() - age_s)
    live.publish_report(
        node_id=node_id, hostname=f"n{node_id}", datacenter="dc", endpoint="http://x", report={}
    )
    monkeypatch.setattr(live.time, "time", real)


def test_the_largest_recent_delay_counts_and_old_ones_expire():
    now = time.monotonic()
    looplag.note(0.5, at=now - 30)
    looplag.note(2.0, at=now - 3)
    looplag.note(0.1, at=now - 1)
    assert looplag.recent_s(6) == pytest.approx(2.0)
    assert looplag.recent_s(2) == pytest.approx(0.1)
    assert looplag.recent_s(60) == pytest.approx(2.0)
    looplag.note(-1.0)  # early wake-ups are not negative delays
    assert looplag.recent_s(0.5) == 0.0


def test_a_report_older_than_the_ttl_is_fresh_while_this_process_ran_late(settings, monkeypatch):
    settings.BATON_HEARTBEAT_INTERVAL_S = 2.0
    settings.BATON_HEARTBEAT_MISSES = 3  # TTL 6 s
    _publish_aged(monkeypatch, 1, 7.0)
    _publish_aged(monkeypatch, 2, 3.0)
    assert sorted(e["node_id"] for e in live.read_reports()) == [2]
    looplag.note(2.5)  # the loop ran 2.5 s behind: beats were taken that much later
    assert sorted(e["node_id"] for e in live.read_reports()) == [1, 2]
    _publish_aged(monkeypatch, 3, 9.0)  # older than TTL + delay: still left out
    assert sorted(e["node_id"] for e in live.read_reports()) == [1, 2]
    assert sorted(e["node_id"] for e in live.read_reports(max_age_s=6.0)) == [2]


def test_the_watch_notes_a_blocked_loop():
    async def scenario():
        task = looplag.start()
        await asyncio.sleep(0.15)
        time.sleep(0.4)  # the loop is blocked: the watch wakes late
        await asyncio.sleep(0.25)
        task.cancel()
        return looplag.recent_s(10)

    assert asyncio.run(scenario()) >= 0.2
