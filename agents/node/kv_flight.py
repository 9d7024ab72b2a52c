"""MD's KV in flight (agents/node/inflight.py compares the prompts): the DRC reservations
that pin a request's cached prefix until its KV is imported, the requests whose KV is on its
way here (which later reservations count as cached), the pins handed from an import to the
reservations that counted on it, and the figures of the state document's ``kv_in_flight``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np

from agents.engine.core import EngineCore as Engine
from agents.node.inflight import block_prefix_len
from agents.node.instances import Instance, Instances
from agents.node.settings import AgentSettings
from agents.node.worker import EngineWorker
from pdd.prefix import prefix_block_hashes


@dataclass(slots=True, eq=False)
class Reservation:
    """MD's DRC pin for one request, until its KV is imported or the reservation is dropped.

    `nodes` are radix TreeNodes locked on the engine thread for this request: the cached
    prefix matched at reserve time and, when `depends_on` names an incoming request, the
    prefix that request's import put in the cache. Whoever pops the reservation from
    `KvInFlight` unlocks the nodes it holds at that moment, once; a pin for a
    reservation no longer there is unlocked by whoever made it."""

    instance_id: str
    nodes: list[Any]
    cached_tokens: int
    created_at: float
    # An incoming request whose KV `cached_tokens` counts on: import only after it landed.
    depends_on: Incoming | None = None
    # The request's KV arrived and its importer owns the reservation (the expiry sweep skips it).
    claimed: bool = False


@dataclass(slots=True, eq=False)
class Incoming:
    """A request whose KV is committed to an MD instance: reserved, on its way over the WAN.
    Later reservations on that instance count its prompt's whole blocks as cached."""

    request_id: str
    instance_id: str
    tokens: np.ndarray  # the prompt (inflight.as_tokens)
    created_at: float
    done: asyncio.Event = field(default_factory=asyncio.Event)  # imported, failed or dropped
    landed: bool = False  # its import succeeded: its prompt's whole blocks are in the cache
    # (request id, prompt[:cached_tokens]) of the reservations counting on this KV, pinned by
    # the engine call that imports it. Appended on the loop, copied on the engine thread.
    dependents: list[tuple[str, Sequence[int]]] = field(default_factory=list)


class KvInFlight:
    """MD's reservations and the KV incoming to its instances, by request id. The pipelines
    change them through these methods only; the mappings are read-only views. Lives on the
    event loop's thread."""

    def __init__(self, settings: AgentSettings, instances: Instances) -> None:
        self.settings = settings
        self._instances = instances
        self._reservations: dict[str, Reservation] = {}
        self._incoming: dict[str, Incoming] = {}
        self._incoming_blocks: dict[str, tuple[str, ...]] = {}  # request id -> its prompt's
        # prefix-block hashes, computed once (incoming_block_hashes)
        # Reservations that answered more than the radix cache held, counting KV in flight.
        self.prefix_hits = 0
        # Imports whose counted-on prefix never landed, so MD recomputed it, and its tokens.
        self.recomputed_imports = 0
        self.recomputed_tokens = 0
        # Requests whose KV MD cached after RLD had finished them alone (DRC alignment).
        self.late_kv_cached = 0

    @property
    def reservations(self) -> Mapping[str, Reservation]:
        return MappingProxyType(self._reservations)

    @property
    def incoming(self) -> Mapping[str, Incoming]:
        return MappingProxyType(self._incoming)

    def reservation(self, request_id: str) -> Reservation | None:
        return self._reservations.get(request_id)

    def incoming_of(self, request_id: str) -> Incoming | None:
        return self._incoming.get(request_id)

    def record(
        self,
        request_id: str,
        instance_id: str,
        node: Any,
        matched: int,
        prompt: Sequence[int],
        tokens: np.ndarray,
    ) -> Reservation:
        """Reserve `prompt` (`tokens`) on that instance with `node` pinned (`matched` tokens
        cached); when KV in flight there shares a longer whole-block prefix, count it as cached
        and depend on it. The request's own KV becomes incoming in turn."""
        now = time.monotonic()
        reservation = Reservation(instance_id, [node], matched, now)
        source, counted = self.best_incoming(instance_id, tokens, request_id)
        if source is not None and counted > matched:
            reservation.cached_tokens = counted
            reservation.depends_on = source
            source.dependents.append((request_id, prompt[:counted]))
            self.prefix_hits += 1
        self._reservations[request_id] = reservation
        self._incoming[request_id] = Incoming(request_id, instance_id, tokens, now)
        return reservation

    def claim(self, request_id: str, instance_id: str) -> Reservation | None:
        """The request's reservation on that instance, marked claimed by its importer (the
        expiry sweep skips it); None if there is none."""
        res = self._reservations.get(request_id)
        if res is None or res.instance_id != instance_id:
            return None
        res.claimed = True
        return res

    def take(self, request_id: str, res: Reservation) -> bool:
        """Remove `res` for its importer (whoever removes a reservation unlocks its pins);
        False if it is no longer there (dropped: cancelled or expired)."""
        if self._reservations.get(request_id) is not res:
            return False
        del self._reservations[request_id]
        return True

    def note_recomputed(self, tokens: int) -> None:
        self.recomputed_imports += 1
        self.recomputed_tokens += tokens

    def note_late_cached(self) -> None:
        self.late_kv_cached += 1

    async def sweep(self, now: float) -> None:
        """Drop stale reservations, and incoming entries no reservation holds any more."""
        for rid, res in list(self._reservations.items()):
            if not res.claimed and now - res.created_at > self.settings.reserve_ttl_s:
                await self.unreserve(rid)
        # Belt and braces: every path that ends a request finishes its incoming entry.
        stale = self.settings.reserve_ttl_s + 2 * self.settings.kv_timeout_s
        for rid, inc in list(self._incoming.items()):
            if rid not in self._reservations and now - inc.created_at > stale:
                self.finish_incoming(rid)

    def to_json(self) -> dict[str, int]:
        """The state document's ``kv_in_flight``."""
        return {
            "incoming": len(self._incoming),
            "reservations": len(self._reservations),
            "prefix_hits": self.prefix_hits,
            "recomputed_imports": self.recomputed_imports,
            "recomputed_tokens": self.recomputed_tokens,
        }

    async def unreserve(self, request_id: str) -> None:
        """Drop request_id's reservation (cancel, expiry, after its import): unlock its pins,
        and stop counting its KV as incoming (whoever waits for it wakes up)."""
        res = self._reservations.pop(request_id, None)
        self.finish_incoming(request_id)
        if res is None:
            return
        nodes = list(res.nodes)
        res.nodes.clear()
        inst = self._instances.get(res.instance_id)
        if nodes and inst is not None and inst.worker is not None:
            await inst.worker.call(lambda engine: unlock_all(engine, nodes))

    def finish_incoming(
        self,
        request_id: str,
        *,
        landed: bool = False,
        pins: Sequence[tuple[str, Any]] = (),
        inst: Instance | None = None,
    ) -> None:
        """request_id's KV import finished (`landed`: it succeeded), or its reservation was
        dropped: hand `pins` (TreeNodes its import locked for dependent reservations) to those
        reservations, and wake whoever waits. Idempotent; runs on the loop."""
        inc = self._incoming.pop(request_id, None)
        if inst is None and inc is not None:
            inst = self._instances.get(inc.instance_id)
        worker = inst.worker if inst is not None else None
        pinned: set[str] = set()
        orphans: list[Any] = []
        for dep_rid, node in pins:
            res = self._reservations.get(dep_rid)
            if res is not None and depends_on(res, request_id):
                res.nodes.append(node)
                pinned.add(dep_rid)
            else:
                orphans.append(node)  # the dependent is gone (imported, timed out, cancelled)
        if orphans and worker is not None:
            worker.call(lambda engine: unlock_all(engine, orphans))
        if inc is None:
            return
        inc.landed = landed
        if landed and worker is not None:
            # Dependents that registered after the import's engine call had started.
            for dep_rid, prefix in list(inc.dependents):
                if dep_rid not in pinned and dep_rid in self._reservations:
                    self._pin_late(worker, request_id, dep_rid, prefix)
        inc.done.set()

    def _pin_late(self, worker: EngineWorker, source: str, dep_rid: str, prefix) -> None:
        def pin(engine: Engine) -> Any:
            node = engine.cache.match_prefix(prefix).node
            engine.cache.lock(node)
            return node

        def attach(future: asyncio.Future) -> None:
            if future.cancelled() or future.exception() is not None:
                return
            res = self._reservations.get(dep_rid)
            if res is not None and depends_on(res, source):
                res.nodes.append(future.result())
            else:
                node = future.result()
                worker.call(lambda engine: engine.cache.unlock(node))

        worker.call(pin).add_done_callback(attach)

    def best_incoming(
        self, instance_id: str, tokens: np.ndarray, exclude: str
    ) -> tuple[Incoming | None, int]:
        """The incoming request on that instance sharing the longest whole-block prefix with
        `tokens`, and that length."""
        best: Incoming | None = None
        best_len = 0
        bs = self.settings.block_size
        for rid, inc in self._incoming.items():
            if rid == exclude or inc.instance_id != instance_id or inc.done.is_set():
                continue
            length = block_prefix_len(tokens, inc.tokens, bs)
            if length > best_len:
                best, best_len = inc, length
        return best, best_len

    def incoming_block_hashes(self, instance_id: str, limit: int = 8192) -> list[str]:
        """Prefix-block hashes (pdd/prefix.py, this agent's block size) of the prompts whose
        KV is in flight to `instance_id`, newest request first, at most `limit`: the
        heartbeat's `incoming_prefix_blocks`, which routing counts as held here, as `reserve`
        counts that KV. Each request's hashes are computed once, on the event loop."""
        memo = self._incoming_blocks
        for rid in [rid for rid in memo if rid not in self._incoming]:
            del memo[rid]
        bs = self.settings.block_size
        out: dict[str, None] = {}
        for rid, inc in reversed(self._incoming.items()):
            if inc.instance_id != instance_id or inc.done.is_set():
                continue
            hashes = memo.get(rid)
            if hashes is None:
                hashes = memo[rid] = prefix_block_hashes(inc.tokens[: limit * bs].tolist(), bs)
            for block in hashes:
                if len(out) >= limit:
                    return list(out)
                out[block] = None
        return list(out)


def depends_on(res: Reservation, request_id: str) -> bool:
    return res.depends_on is not None and res.depends_on.request_id == request_id


def unlock_all(engine: Engine, nodes: Sequence[Any]) -> None:
    """Unlock radix nodes (on the engine thread)."""
    for node in nodes:
        engine.cache.unlock(node)
