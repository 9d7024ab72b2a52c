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
