"""Redis-backed aggregation: two aggregators (as two processes would) share one state."""

from __future__ import annotations

import os
import uuid

import pytest

from frontend.telemetry.aggregator import SLA, Aggregator, summarize
from frontend.telemetry.store import RedisStore

pytestmark = pytest.mark.redis
NOW = 1_800_000_000.0


def record(pipeline: str, ttft: float) -> dict:
    return {"model": "m", "pipeline": pipeline, "status": "ok", "ttft_s": ttft, "created_at": NOW}


def test_two_aggregators_add_into_and_read_the_same_redis_state():
    prefix = f"test-tlm-{uuid.uuid4().hex[:8]}"
    url = os.environ["REDIS_URL"]
    gateway = Aggregator(
        RedisStore(url, prefix=prefix, flush_interval_s=0.05), sla_for=lambda m: SLA()
    )
    web = Aggregator(RedisStore(url, prefix=prefix, flush_interval_s=0.05), sla_for=lambda m: SLA())
    try:
        gateway.observe_many([record("p-md", 1.0)] * 30, now=NOW)
        web.observe_many([record("p-rld-md", 4.0)] * 10, now=NOW)
        gateway.store.flush()
        web.store.flush()
        for reader in (gateway, web):
            p, _ = reader.window("1m", now=NOW + 0.5)
            s = summarize(p, seconds=60, cost_per_hour=None)
            assert s["requests_by_pipeline"] == {"p-md": 30, "p-rld-md": 10}
            assert s["ttft"]["all"]["count"] == 40
            assert sum(reader.totals().requests.values()) == 40
        # a closed second read once is cached; new increments to open seconds are still seen
        gateway.observe(record("p-md", 1.0), now=NOW)
        gateway.store.flush()
        assert sum(web.window("1m", now=NOW + 0.5)[0].requests.values()) == 41
    finally:
        gateway.store.clear()
        gateway.store.close()
        web.store.close()
