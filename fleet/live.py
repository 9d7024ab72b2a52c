"""The latest heartbeat of every node, shared by all control-plane processes.

Heartbeats land on whichever web process the agent reached; gateways in other processes read
them here. Redis when ``REDIS_URL`` is set, this process's memory otherwise.

In Redis a node's entry (what it reports) and its liveness (when it last reported) are kept
apart, so that a reader several times a second fetches only what changed:

- ``baton:live:nodes``: node id -> the entry, rewritten only when the report changed (the
  agent's own heartbeat stats aside) or is older than ``BATON_LIVE_REFRESH_S``;
- ``baton:live:seen``: node id -> the time of its last heartbeat (a few bytes, every beat);
- ``baton:live:changes``: a sorted set, node id scored by the version (``baton:live:version``,
  one counter) of its last rewrite or removal.

A reader keeps a mirror of the entries and the version it has read up to; each read is one
round trip for the version, the nodes changed since and the liveness hash, and a second one for
the changed entries only. A new epoch (``baton:live:epoch``, set by the first write after Redis
started empty) or a version lower than the mirror's makes it reload everything.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
import uuid
from typing import Any

from django.conf import settings

from pdd import looplag

_KEY = "baton:live:nodes"
_SEEN = "baton:live:seen"
_CHANGES = "baton:live:changes"
_VERSION = "baton:live:version"
_EPOCH = "baton:live:epoch"
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
        _mirror.reset()  # a new client may be another server (tests switch REDIS_URL)
    return _redis_client


def live_ttl_s() -> float:
    return float(settings.BATON_HEARTBEAT_INTERVAL_S) * int(settings.BATON_HEARTBEAT_MISSES)


# Keys of a report that change at every beat without changing what the node runs or its load:
# the agent's account of its own heartbeats. An entry that differs only there is rewritten at
# most every BATON_LIVE_REFRESH_S.
_VOLATILE_KEYS = frozenset({"control_plane"})
# Per process: node id -> (digest of the last entry written, when).
_written: dict[str, tuple[bytes, float]] = {}
_written_lock = threading.Lock()


def _digest(hostname: str, datacenter: str, endpoint: str, report: dict[str, Any]) -> bytes:
    steady = {k: v for k, v in report.items() if k not in _VOLATILE_KEYS}
    text = json.dumps([hostname, datacenter, endpoint, steady], sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


# A rewrite or a removal and its place in the change log, atomically: a reader never sees the
# version move past a change it cannot find.
_WRITE = """
redis.call('SETNX', KEYS[5], ARGV[4])
local v = redis.call('INCR', KEYS[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('HSET', KEYS[3], ARGV[1], ARGV[3])
redis.call('ZADD', KEYS[4], v, ARGV[1])
return v
"""
_SEEN_ONLY = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
return 1
"""
_LIVENESS = """
for i = 1, #ARGV, 2 do
  if redis.call('HEXISTS', KEYS[1], ARGV[i]) == 1 then
    redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1])
  end
end
return 1
"""
_REMOVE = """
local v = redis.call('INCR', KEYS[1])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('ZADD', KEYS[4], v, ARGV[1])
return v
"""
_scripts: dict[tuple[int, str], Any] = {}


def _script(client, source: str):
    key = (id(client), source)
    script = _scripts.get(key)
    if script is None:
        script = _scripts[key] = client.register_script(source)
    return script


def publish_report(
    *, node_id: int, hostname: str, datacenter: str, endpoint: str, report: dict[str, Any]
) -> None:
    now = time.time()
    key = str(node_id)
    entry = {
        "node_id": node_id,
        "hostname": hostname,
        "datacenter": datacenter,
        "endpoint": endpoint,
        "received_at": now,
        "report": report,
    }
    client = _redis()
    if client is None:
        with _memory_lock:
            _memory[key] = json.dumps(entry)
        return
    digest = _digest(hostname, datacenter, endpoint, report)
    refresh_s = float(settings.BATON_LIVE_REFRESH_S)
    with _written_lock:
        last = _written.get(key)
    if (
        last is not None
        and last[0] == digest
        and now - last[1] < refresh_s
        and _script(client, _SEEN_ONLY)(keys=[_KEY, _SEEN], args=[key, repr(now)])
    ):
        return
    _script(client, _WRITE)(
        keys=[_VERSION, _KEY, _SEEN, _CHANGES, _EPOCH],
        args=[key, json.dumps(entry), repr(now), uuid.uuid4().hex],
    )
    with _written_lock:
        _written[key] = (digest, now)


def publish_liveness(seen: dict[int, float]) -> None:
    """Heartbeats that repeated their node's last report (fleet.beats): only when each node
    was last heard of (wall time), for nodes whose entry the live view holds."""
    if not seen:
        return
    client = _redis()
    if client is None:
        with _memory_lock:
            for node_id, at in seen.items():
                raw = _memory.get(str(node_id))
                if raw is not None:
                    entry = json.loads(raw)
                    entry["received_at"] = max(float(entry.get("received_at") or 0.0), at)
                    _memory[str(node_id)] = json.dumps(entry)
        return
    args: list[str] = []
    for node_id, at in seen.items():
        args += [str(node_id), repr(at)]
    _script(client, _LIVENESS)(keys=[_KEY, _SEEN], args=args)


class _Mirror:
    """This process's copy of the Redis entries, brought up to date at each read."""

    def __init__(self) -> None:
        self.epoch: bytes | None = None
        self.version = 0
        self.entries: dict[str, dict[str, Any]] = {}
        self.lock = threading.Lock()

    def refresh(self, client) -> dict[str, float]:
        """Fetch what changed since the last read; returns every node's liveness."""
        with self.lock:
            pipe = client.pipeline(transaction=False)
            pipe.get(_EPOCH)
            pipe.get(_VERSION)
            pipe.zrangebyscore(_CHANGES, f"({self.version}", "+inf")
            pipe.hgetall(_SEEN)
            epoch, raw_version, changed, seen = pipe.execute()
            version = int(raw_version or 0)
            if epoch != self.epoch or version < self.version:  # new, or Redis lost its state
                self.epoch = epoch
                self.entries.clear()
                changed = client.hkeys(_KEY)
            if changed:
                keys = [_text(k) for k in changed]
                for key, raw in zip(keys, client.hmget(_KEY, keys), strict=True):
                    if raw is None:
                        self.entries.pop(key, None)
                    else:
                        self.entries[key] = json.loads(raw)
            self.version = version
            return {_text(k): float(v) for k, v in seen.items()}

    def reset(self) -> None:
        with self.lock:
            self.epoch, self.version = None, 0
            self.entries.clear()


_mirror = _Mirror()


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def fresh_age_s() -> float:
    """The age up to which a report is fresh: the live TTL, plus this process's own recent
    delay in taking the beats, which is not the node's (pdd/looplag.py)."""
    return live_ttl_s() + looplag.recent_s(live_ttl_s())


def late_age_s() -> float:
    """The age up to which a report past ``fresh_age_s`` is only late, not lost: its node is
    taken to be alive but reaching this control plane slowly (``BATON_LIVE_LATE_S`` more)."""
    return fresh_age_s() + float(settings.BATON_LIVE_LATE_S)


def read_reports(*, max_age_s: float | None = None) -> list[dict[str, Any]]:
    """Fresh node reports (older than `max_age_s`, default ``fresh_age_s``, are left out).
    Callers must not change the dicts they get."""
    if max_age_s is None:
        max_age_s = fresh_age_s()
    now = time.time()
    client = _redis()
    if client is None:
        with _memory_lock:
            raw = list(_memory.values())
        entries = [_parsed(item) for item in raw]
        return [e for e in entries if now - e["received_at"] <= max_age_s]
    seen = _mirror.refresh(client)
    fresh = []
    for key, entry in list(_mirror.entries.items()):
        at = max(seen.get(key, 0.0), entry["received_at"])
        if now - at <= max_age_s:
            fresh.append(entry if at == entry["received_at"] else entry | {"received_at": at})
    return fresh


# The last parse of each report, by its text (memory mode): a node reports every heartbeat
# interval while gateways read the reports several times a second, so most reads find the same
# text again. Callers must not change the dicts they get.
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
    key = str(node_id)
    with _written_lock:
        _written.pop(key, None)
    client = _redis()
    if client is None:
        with _memory_lock:
            _memory.pop(key, None)
        return
    _script(client, _REMOVE)(keys=[_VERSION, _KEY, _SEEN, _CHANGES], args=[key])
