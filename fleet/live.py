"""The latest heartbeat of every node, shared by all control-plane processes.

Heartbeats land on whichever web process the agent reached; gateways in other processes read
them here. Redis when ``REDIS_URL`` is set, this process's memory otherwise.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

from django.conf import settings

_KEY = "baton:live:nodes"
_memory: dict[str, str] = {}
_memory_lock = threading.Lock()
_redis_client = None


def _redis():
    global _redis_client
    if not settings.REDIS_URL:
        return None
    if _redis_client is None:
        import redis

        _redis_client = redis.Redis.from_url(settings.REDIS_URL, socket_timeout=2)
    return _redis_client


def live_ttl_s() -> float:
    return float(settings.BATON_HEARTBEAT_INTERVAL_S) * int(settings.BATON_HEARTBEAT_MISSES)


def publish_report(
    *, node_id: int, hostname: str, datacenter: str, endpoint: str, report: dict[str, Any]
) -> None:
    entry = json.dumps(
        {
            "node_id": node_id,
            "hostname": hostname,
            "datacenter": datacenter,
            "endpoint": endpoint,
            "received_at": time.time(),
            "report": report,
        }
    )
    client = _redis()
    if client is not None:
        client.hset(_KEY, str(node_id), entry)
        return
    with _memory_lock:
        _memory[str(node_id)] = entry


def read_reports(*, max_age_s: float | None = None) -> list[dict[str, Any]]:
    """Fresh node reports (older than `max_age_s`, default the offline threshold, are left out)."""
    max_age_s = live_ttl_s() if max_age_s is None else max_age_s
    client = _redis()
    if client is not None:
        raw = list(client.hgetall(_KEY).values())
    else:
        with _memory_lock:
            raw = list(_memory.values())
    now = time.time()
    entries = [_parsed(item) for item in raw]
    return [e for e in entries if now - e["received_at"] <= max_age_s]


# The last parse of each report, by its text: a node reports every heartbeat interval while
# gateways read the reports several times a second, so most reads find the same text again.
# Callers must not change the dicts they get.
_parse_memo: dict[str | bytes, dict[str, Any]] = {}
_parse_lock = threading.Lock()


def _parsed(raw: str | bytes) -> dict[str, Any]:
    with _parse_lock:
        hit = _parse_memo.get(raw)
    if hit is not None:
        return hit
    entry = json.loads(raw)
    with _parse_lock:
        if len(_parse_memo) > 4096:  # old heartbeats: start over
            _parse_memo.clear()
        _parse_memo[raw] = entry
    return entry


def forget(node_id: int) -> None:
    client = _redis()
    if client is not None:
        client.hdel(_KEY, str(node_id))
        return
    with _memory_lock:
        _memory.pop(str(node_id), None)
