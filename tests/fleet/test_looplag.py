"""A web process whose event loop runs late takes every node's heartbeats that much later; the
live view allows a report the live TTL plus that delay, so a saturated gateway process does not
take its own lateness for a fleet gone silent (fleet/looplag.py)."""

from __future__ import annotations

import asyncio
import time

import pytest

from fleet import live, looplag


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


@pytest.mark.django_db
def test_the_health_check_allows_the_web_processes_delay(node_a, settings):
    """The database's last heartbeat times come from the same late process: a node silent for
    the TTL plus less than that delay stays online; past it, it goes offline."""
    from datetime import timedelta

    from django.utils import timezone

    from fleet import agent_services
    from fleet.choices import NodeStatus
    from fleet.models import Node

    settings.BATON_HEARTBEAT_INTERVAL_S = 2.0
    settings.BATON_HEARTBEAT_MISSES = 3  # silence 6 s
    now = timezone.now()
    Node.objects.filter(pk=node_a.pk).update(
        status=NodeStatus.ONLINE, last_heartbeat_at=now - timedelta(seconds=7)
    )
    looplag.note(2.5)
    assert live.loop_lag_s() == pytest.approx(2.5)
    assert agent_services.nodes_mark_offline(now=now) == []
    looplag.clear()
    assert agent_services.nodes_mark_offline(now=now) == [node_a.pk]
    assert Node.objects.get(pk=node_a.pk).status == NodeStatus.OFFLINE


@pytest.mark.redis
def test_the_delay_is_shared_through_redis(settings, monkeypatch):
    import os

    settings.REDIS_URL = os.environ["REDIS_URL"]
    monkeypatch.setattr(live, "_redis_client", None)
    client = live._redis()
    client.delete(live._LAG_KEY)
    try:
        live.publish_loop_lag(3.0)  # another web process's delay
        assert live.loop_lag_s() == pytest.approx(3.0)  # this one has none of its own
        client.hset(live._LAG_KEY, "gone:1", f"9.0,{time.time() - 120:.3f}")  # too old
        client.hset(live._LAG_KEY, "bad:2", "not a number")
        assert live.loop_lag_s() == pytest.approx(3.0)
    finally:
        client.delete(live._LAG_KEY)
        monkeypatch.setattr(live, "_redis_client", None)


def test_the_watch_publishes_its_delay():
    published: list[float] = []

    async def scenario():
        task = looplag.start(publish=published.append, window_s=10)
        await asyncio.sleep(0.15)
        time.sleep(0.3)
        await asyncio.sleep(1.3)
        task.cancel()

    asyncio.run(scenario())
    assert published and max(published) >= 0.15
