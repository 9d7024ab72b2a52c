"""KV cache events: what a decode instance's prefix cache stored and removed, published to the
control plane's prefix index (docs/PROTOCOL.md, "KV cache events").

The engine thread records the cache's changes (RadixCache.drain_events) into the instance's
KVEventLog after every step and command; the publisher (below) posts them, in order, in
numbered batches. Each batch carries the digest of the cache after it (block count and the XOR
of every held block's hash), so the index detects drift; a batch the index cannot place (a gap,
another epoch, a digest that disagrees, an index that lost its state) is answered "resync" and
the agent replaces everything pending with a snapshot of its cache. Nothing is capped: a cache
of millions of blocks is published in batches of at most MAX_BLOCKS_PER_BATCH hashes.

The format follows vLLM's KV events (BlockStored with its parent hash, BlockRemoved,
AllBlocksCleared), as the chain hashes of pdd/prefix.py in hex:

    {"type": "stored", "parent": "<hex>" | null, "blocks": ["<hex>", ...]}
    {"type": "removed", "blocks": ["<hex>", ...]}
    {"type": "cleared"}
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import httpx

from agents.engine.radix_cache import RemovedEvent, StoredEvent

log = logging.getLogger(__name__)

MAX_BLOCKS_PER_BATCH = 16_384  # ~300 KB of JSON
MAX_BLOCKS_PER_POST = 65_536  # ~1.2 MB: under the control plane's body limit
# Beyond this many unacknowledged blocks (the control plane away for long), the log drops them
# and asks for a snapshot once the index is reachable again.
MAX_PENDING_BLOCKS = 4_000_000


def _int(h: bytes) -> int:
    return int.from_bytes(h, "big")  # as the index reads the hex: int(hex, 16)


class KVEventLog:
    """One instance's events in numbered batches. The engine thread records; the publisher's
    event loop takes and acknowledges; a lock keeps the two apart."""

    def __init__(self, instance_id: str) -> None:
        self.instance_id = instance_id
        # A new epoch per engine: the index starts over from its first batch ("cleared").
        self.epoch = secrets.token_hex(6)
        self.seq = 0  # the last batch numbered
        self.acked = 0  # the last batch the index acknowledged
        self.count = 0  # blocks held after every recorded event
        self.xor = 0
        self._open: list[dict[str, Any]] = [{"type": "cleared"}]
        self._open_blocks = 0
        self._pending: deque[dict[str, Any]] = deque()
        self._pending_blocks = 0
        self.resync_wanted = False
        self.resyncs = 0
        self._lock = threading.Lock()

    # -- engine thread ------------------------------------------------------------------------

    def record(self, events: Iterable[StoredEvent | RemovedEvent]) -> None:
        with self._lock:
            for event in events:
                if not event.hashes:
                    continue
                if isinstance(event, StoredEvent):
                    self._add(
                        {
                            "type": "stored",
                            "parent": event.parent.hex() if event.parent else None,
                            "blocks": [h.hex() for h in event.hashes],
                        },
                        event.hashes,
                        +1,
                    )
                else:
                    self._add(
                        {"type": "removed", "blocks": [h.hex() for h in event.hashes]},
                        event.hashes,
                        -1,
                    )
            if self._pending_blocks + self._open_blocks > MAX_PENDING_BLOCKS:
                # The index has been away too long: what it lacks is sent as a snapshot.
                self._pending.clear()
                self._open, self._open_blocks, self._pending_blocks = [], 0, 0
                self.resync_wanted = True

    def _add(self, event: dict[str, Any], hashes: list[bytes], sign: int) -> None:
        x = self.xor
        for h in hashes:
            x ^= _int(h)
        self.xor = x
        self.count += sign * len(hashes)
        self._open.append(event)
        self._open_blocks += len(hashes)
        if self._open_blocks >= MAX_BLOCKS_PER_BATCH:
            self._close()

    def reset(self, edges: list[tuple[bytes, list[bytes]]]) -> None:
        """Replace everything pending with a snapshot of the cache (``held_hashes``): a
        "cleared" event, then every edge stored. Runs on the engine thread, between steps, so no
        event falls between the snapshot and the reset."""
        with self._lock:
            self._pending.clear()
            self._pending_blocks = 0
            self._open, self._open_blocks = [{"type": "cleared"}], 0
            self.count, self.xor = 0, 0
            for parent, hashes in edges:
                if hashes:
                    self._add(
                        {
                            "type": "stored",
                            "parent": parent.hex() if parent else None,
                            "blocks": [h.hex() for h in hashes],
                        },
                        hashes,
                        +1,
                    )
            self._close()
            self.resync_wanted = False
            self.resyncs += 1

    def _close(self) -> None:
        if not self._open:
            return
        self.seq += 1
        self._pending.append(
            {"seq": self.seq, "events": self._open, "digest": self.digest_locked()}
        )
        self._pending_blocks += self._open_blocks
        self._open, self._open_blocks = [], 0

    def digest_locked(self) -> dict[str, Any]:
        return {"blocks": self.count, "xor": f"{self.xor:016x}"}

    # -- publisher ----------------------------------------------------------------------------

    def take(self, budget_blocks: int) -> list[dict[str, Any]]:
        """The pending batches, oldest first, up to about ``budget_blocks`` hashes (at least
        one batch); the open events are closed into a batch first."""
        with self._lock:
            self._close()
            out: list[dict[str, Any]] = []
            used = 0
            for batch in self._pending:
                size = sum(len(e.get("blocks", ())) for e in batch["events"])
                if out and used + size > budget_blocks:
                    break
                out.append(batch)
                used += size
            return out

    def ack(self, seq: int) -> None:
        with self._lock:
            while self._pending and self._pending[0]["seq"] <= seq:
                batch = self._pending.popleft()
                self._pending_blocks -= sum(len(e.get("blocks", ())) for e in batch["events"])
            self.acked = max(self.acked, seq)

    def summary(self) -> dict[str, Any]:
        """What the index should hold once every pending batch is in (for the state document
        and the publisher's keep-alive)."""
        with self._lock:
            return {
                "epoch": self.epoch,
                "seq": self.seq,
                "acked": self.acked,
                "pending_batches": len(self._pending) + bool(self._open),
                "digest": self.digest_locked(),
                "resyncs": self.resyncs,
            }


class _Agent(Protocol):
    """What the publisher reads of agents.node.agent.Agent."""

    registered: bool

    @property
    def instances(self) -> Mapping[str, Any]: ...


class KVEventPublisher:
    """Posts every decode instance's KV events to ``/api/v1/agent/kv-events``: as soon as any
    are pending (checked every ``interval_s``), and a keep-alive summary every ``keepalive_s``
    so an index that lost its state (a restarted control plane) asks for a snapshot."""

    def __init__(
        self,
        agent: _Agent,
        base_url: str,
        headers: dict[str, str],
        *,
        interval_s: float = 0.25,
        keepalive_s: float = 5.0,
    ) -> None:
        self.agent = agent
        self.url = base_url.rstrip("/") + "/api/v1/agent/kv-events"
        self.headers = headers
        self.interval_s = interval_s
        self.keepalive_s = keepalive_s
        self.posts = 0
        self.failures = 0
        self._last_post = 0.0
        self._backoff_s = 0.0

    def logs(self) -> dict[str, KVEventLog]:
        return {
            iid: inst.kv_events
            for iid, inst in list(self.agent.instances.items())
            if inst.kv_events is not None and inst.worker is not None
        }

    async def _resync(self, logs: dict[str, KVEventLog]) -> None:
        for iid, kv_log in logs.items():
            if not kv_log.resync_wanted:
                continue
            inst = self.agent.instances.get(iid)
            if inst is None or inst.worker is None:
                continue

            def snapshot(engine: Any, kv_log: KVEventLog = kv_log) -> None:
                engine.cache.drain_events()  # already in the snapshot
                kv_log.reset(engine.cache.held_hashes())

            try:
                await inst.worker.call(snapshot)
            except Exception:  # noqa: BLE001 - retried on the next round
                log.exception("KV cache snapshot of %s failed", iid)

    async def publish_once(self, http: httpx.AsyncClient) -> bool:
        """One round: post what is pending (or a keep-alive when due). True when posted."""
        logs = self.logs()
        await self._resync(logs)
        body: list[dict[str, Any]] = []
        budget = MAX_BLOCKS_PER_POST
        for iid, kv_log in logs.items():
            batches = kv_log.take(max(budget, 1))
            budget -= sum(len(e.get("blocks", ())) for b in batches for e in b["events"])
            body.append({"instance_id": iid, **kv_log.summary(), "batches": batches})
        now = time.monotonic()
        if not body or (
            not any(item["batches"] for item in body) and now - self._last_post < self.keepalive_s
        ):
            return False
        self._last_post = now
        response = await http.post(self.url, json={"instances": body}, headers=self.headers)
        if response.status_code != 200:
            raise httpx.HTTPStatusError(
                f"HTTP {response.status_code}: {response.text[:300]}",
                request=response.request,
                response=response,
            )
        self.posts += 1
        answers = (response.json() or {}).get("instances") or {}
        for iid, kv_log in logs.items():
            answer = answers.get(iid) or {}
            if "acked" in answer:
                kv_log.ack(int(answer["acked"]))
            if answer.get("resync"):
                log.info("prefix index asks %s for a snapshot: %s", iid, answer.get("reason"))
                kv_log.resync_wanted = True
        return True

    async def run(self) -> None:
        timeout = httpx.Timeout(10.0, connect=5.0)
        async with httpx.AsyncClient(timeout=timeout) as http:
            while True:
                try:
                    if self.agent.registered:
                        await self.publish_once(http)
                    self._backoff_s = 0.0
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # noqa: BLE001 - pending batches wait for the next try
                    self.failures += 1
                    self._backoff_s = min(30.0, max(self.interval_s, self._backoff_s * 2))
                    log.warning(
                        "KV events not delivered (retry in %.1f s): %s", self._backoff_s, exc
                    )
                await asyncio.sleep(max(self.interval_s, self._backoff_s))
