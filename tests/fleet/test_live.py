"""Latest node reports shared between processes (Redis) or kept in one process."""

from __future__ import annotations

import os
import time

import pytest

from fleet import live


def test_reports_round_trip_in_process(settings):
    settings.REDIS_URL = ""
    live.publish_report(
        node_id=9001, hostname="n", datacenter="dc-a", endpoint="http://x", report={"instances": []}
    )
    entries = [e for e in live.read_reports() if e["node_id"] == 9001]
    assert entries[0]["hostname"] == "n"
    assert entries[0]["report"] == {"instances": []}
    live.forget(9001)
    assert [e for e in live.read_reports() if e["node_id"] == 9001] == []


def test_stale_reports_are_left_out(settings):
    settings.REDIS_URL = ""
    live.publish_report(node_id=9002, hostname="n", datacenter="dc-a", endpoint="", report={})
    time.sleep(0.05)
    assert [e for e in live.read_reports(max_age_s=0.01) if e["node_id"] == 9002] == []
    live.forget(9002)


@pytest.mark.redis
def test_reports_are_shared_through_redis(settings, monkeypatch):
    settings.REDIS_URL = os.environ["REDIS_URL"]
    monkeypatch.setattr(live, "_redis_client", None)
    live.publish_report(node_id=9003, hostname="r", datacenter="dc-b", endpoint="", report={"a": 1})
    # A second process has no memory of it; read through a fresh client to prove it is in Redis.
    monkeypatch.setattr(live, "_redis_client", None)
    monkeypatch.setattr(live, "_memory", {})
    assert [e["report"] for e in live.read_reports() if e["node_id"] == 9003] == [{"a": 1}]
    live.forget(9003)


@pytest.fixture
def redis_live(settings, monkeypatch):
    """The live view on a fresh Redis client, with this test's keys removed afterwards."""
    settings.REDIS_URL = os.environ["REDIS_URL"]
    monkeypatch.setattr(live, "_redis_client", None)
    monkeypatch.setattr(live, "_written", {})
    client = live._redis()
    yield client
    for node_id in range(9100, 9110):
        live.forget(node_id)


def _publish(node_id: int, report: dict) -> None:
    live.publish_report(
        node_id=node_id, hostname=f"n{node_id}", datacenter="dc", endpoint="", report=report
    )


@pytest.mark.redis
def test_a_reader_fetches_only_what_changed(redis_live, monkeypatch):
    _publish(9100, {"instances": [], "load": 1})
    _publish(9101, {"instances": [], "load": 2})
    loads = {e["node_id"]: e["report"].get("load") for e in live.read_reports()}
    assert loads.items() >= {9100: 1, 9101: 2}.items()
    fetched: list[list[str]] = []
    real_hmget = redis_live.hmget
    monkeypatch.setattr(
        redis_live, "hmget", lambda key, keys: fetched.append(list(keys)) or real_hmget(key, keys)
    )
    _publish(9101, {"instances": [], "load": 3})
    reports = {e["node_id"]: e["report"].get("load") for e in live.read_reports()}
    assert reports[9100] == 1 and reports[9101] == 3
    assert fetched == [["9101"]]
    # Nothing changed: no entry fetched at all.
    live.read_reports()
    assert fetched == [["9101"]]


@pytest.mark.redis
def test_unchanged_reports_only_move_the_liveness(redis_live):
    _publish(9102, {"instances": [], "control_plane": {"answered": 1}})
    first = next(e for e in live.read_reports() if e["node_id"] == 9102)
    version = int(redis_live.get(live._VERSION))
    time.sleep(0.01)
    _publish(9102, {"instances": [], "control_plane": {"answered": 2}})
    assert int(redis_live.get(live._VERSION)) == version  # the entry was not rewritten
    again = next(e for e in live.read_reports() if e["node_id"] == 9102)
    assert again["received_at"] > first["received_at"]
    # A change the routing reads is written at once.
    _publish(9102, {"instances": [{"instance_id": "1"}], "control_plane": {"answered": 3}})
    assert int(redis_live.get(live._VERSION)) == version + 1
    latest = next(e for e in live.read_reports() if e["node_id"] == 9102)
    assert latest["report"]["instances"] == [{"instance_id": "1"}]


@pytest.mark.redis
def test_stale_entries_refresh_and_removals_reach_readers(redis_live, settings):
    settings.BATON_LIVE_REFRESH_S = 0.0
    _publish(9103, {"instances": [], "control_plane": {"answered": 1}})
    _publish(9103, {"instances": [], "control_plane": {"answered": 2}})
    entry = next(e for e in live.read_reports() if e["node_id"] == 9103)
    assert entry["report"]["control_plane"] == {"answered": 2}
    live.forget(9103)
    assert [e for e in live.read_reports() if e["node_id"] == 9103] == []


@pytest.mark.redis
def test_a_reader_reloads_when_redis_lost_its_state(redis_live):
    _publish(9104, {"instances": [], "load": 1})
    assert any(e["node_id"] == 9104 for e in live.read_reports())
    for key in (live._KEY, live._SEEN, live._CHANGES, live._VERSION, live._EPOCH):
        redis_live.delete(key)
    # The writer's memory says "unchanged", but the entry is gone: it is written again.
    _publish(9104, {"instances": [], "load": 1})
    _publish(9105, {"instances": [], "load": 5})
    loads = {e["node_id"]: e["report"].get("load") for e in live.read_reports()}
    assert loads[9104] == 1 and loads[9105] == 5
