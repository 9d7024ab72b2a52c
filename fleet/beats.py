"""Heartbeats that change nothing, taken on the event loop: no Django request, no thread, no
database round trip per beat.

At a thousand nodes beating every 2 s a web process takes 500 heartbeats a second; through
Django and DRF even the fast path of ``agent_services.node_heartbeat_unchanged`` costs a
thread, a token lookup and an UPDATE each, more than one process has. Most beats repeat the
node's last full one (its instances' states, loads and reports; only the agent's own heartbeat
stats move), so the ASGI handler (controlplane/middleware.py) asks ``take`` first:

- the token must be one a full heartbeat of this process authenticated (the hash of the token
  -> the node id), trusted for ``TOKEN_TTL_S`` after that or after the last flush that found
  it still the node's (each flush compares the tokens of its beats with the database: a
  rotation or a deleted node, in any process, ends the fast path at the next flush; a save of
  the node in this process at once);
- the document must say what the node's last full heartbeat in this process said, at most
  ``BATON_HEARTBEAT_FULL_EVERY_S`` ago (``agent_services.full_beat_current``);
- then the beat is noted and answered ``{"ok": true}`` at once. A flusher thread writes the
  noted beats every ``FLUSH_S``: one UPDATE of ``last_heartbeat_at`` for all of them (the time
  of the oldest beat of the batch: a node never looks fresher than it is) for the nodes that
  are still online, and their liveness in the live view; a node found offline (or deleted)
  is forgotten, so its next beat takes the full path, which brings it back online.

Anything else (a changed document, an unknown token, a body that is not JSON) goes to Django
as before. Lost with a killed process: at most ``FLUSH_S`` of beats, which the next beat
repeats."""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from datetime import UTC, datetime

from django.db import close_old_connections

from fleet import agent_services, live
from fleet.choices import NodeStatus
from fleet.models import Node

log = logging.getLogger(__name__)

TOKEN_TTL_S = 10.0
FLUSH_S = 0.25
OK = b'{"ok":true}'

# sha256(token) -> (node id, monotonic time it stops being trusted)
_tokens: dict[bytes, tuple[int, float]] = {}
_tokens_lock = threading.Lock()
# node id -> (wall time of its first beat noted since the last flush, its token's key)
_pending: dict[int, tuple[float, bytes]] = {}
_pending_lock = threading.Lock()
_flusher: threading.Thread | None = None
_flusher_lock = threading.Lock()
stats = {"taken": 0, "flushes": 0, "flush_errors": 0}


def _key(token: bytes) -> bytes:
    return hashlib.sha256(token).digest()


def remember(token: str, node_id: int) -> None:
    """A full heartbeat authenticated `token` as `node_id`'s: trust it for TOKEN_TTL_S."""
    with _tokens_lock:
        _tokens[_key(token.encode())] = (node_id, time.monotonic() + TOKEN_TTL_S)


def forget_node(node_id: int) -> None:
    """The node changed here (token, status, endpoint...): its next beat takes the full path."""
    with _tokens_lock:
        for key in [k for k, (n, _) in _tokens.items() if n == node_id]:
            del _tokens[key]
    agent_services.forget_full_beat(node_id)


def take(authorization: bytes, body: bytes) -> bool:
    """Take a heartbeat on the fast path; False when it must go to Django."""
    parts = authorization.split()
    if len(parts) != 2 or parts[0].lower() != b"agenttoken":
        return False
    key = _key(parts[1])
    now = time.monotonic()
    with _tokens_lock:
        hit = _tokens.get(key)
    if hit is None or hit[1] < now:
        return False
    node_id = hit[0]
    try:
        data = json.loads(body)
    except ValueError:
        return False
    if not isinstance(data, dict):
        return False
    digest = agent_services.report_digest(agent_services.without_cache_lists(data))
    if not agent_services.full_beat_current(node_id, digest):
        return False
    with _pending_lock:
        _pending.setdefault(node_id, (time.time(), key))
    stats["taken"] += 1
    _ensure_flusher()
    return True


def _ensure_flusher() -> None:
    global _flusher
    if _flusher is not None and _flusher.is_alive():
        return
    with _flusher_lock:
        if _flusher is None or not _flusher.is_alive():
            _flusher = threading.Thread(target=_run, name="baton-beats", daemon=True)
            _flusher.start()


def _run() -> None:
    while True:
        time.sleep(FLUSH_S)
        try:
            flush()
        except Exception:  # one failed flush must not stop the next ones
            stats["flush_errors"] += 1
            log.exception("could not write the heartbeats taken on the fast path")
        finally:
            close_old_connections()


def flush() -> int:
    """Write the beats noted since the last flush; returns how many nodes it wrote."""
    with _pending_lock:
        batch = dict(_pending)
        _pending.clear()
    if not batch:
        return 0
    rows = Node.objects.filter(pk__in=list(batch)).values_list("pk", "status", "agent_token_hash")
    online = set()
    trusted_until = time.monotonic() + TOKEN_TTL_S
    for node_id, status, token_hash in rows:
        key = batch[node_id][1]
        if status == NodeStatus.ONLINE and token_hash == key.hex():
            online.add(node_id)
            with _tokens_lock:  # checked against the database just now: trusted a while more
                if key in _tokens:
                    _tokens[key] = (node_id, trusted_until)
    for node_id in set(batch) - online:
        # Offline meanwhile, deleted, or its token rotated: its next beat goes to Django.
        forget_node(node_id)
    if online:
        oldest = min(batch[n][0] for n in online)
        Node.objects.filter(pk__in=list(online), status=NodeStatus.ONLINE).update(
            last_heartbeat_at=datetime.fromtimestamp(oldest, UTC)
        )
        live.publish_liveness({n: batch[n][0] for n in online})
    stats["flushes"] += 1
    return len(online)
