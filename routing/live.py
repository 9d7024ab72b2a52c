"""The live picture the policy decides on: healthy instances with their load and cached
prefixes (from agents' heartbeats, shared through fleet.live) and the WAN links."""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from itertools import takewhile
from typing import Any

from django.conf import settings
from django.db.models.signals import post_delete, post_save

from fleet import live as fleet_live
from fleet.choices import DesiredState, InstanceRole, NodeStatus
from fleet.choices import LinkStatus as FleetLinkStatus
from fleet.kv_index import prefix_index
from fleet.models import Datacenter, GPUType, Instance, Node, WANLink
from pdd.policy import (
    BlockSet,
    ClusterSnapshot,
    InstanceState,
    LinkStatus,
    WanLinkState,
    leading_run,
)
from routing.caching import TtlCache, shared_cache, versions

log = logging.getLogger(__name__)

IN_DC_RTT_MS = 0.05  # an RDMA-class fabric inside one datacenter
SNAPSHOT_MAX_AGE_S = 0.25  # rebuild at most 4x a second per process, however many requests


@dataclass(slots=True)
class Endpoint:
    """Where to reach one instance: its agent's HTTP API and its KV receive port."""

    instance_id: str
    role: str
    datacenter: str
    http: str
    kv_host: str = ""
    kv_port: int = 0
    wan_port: int = 0


@dataclass(slots=True)
class LiveView:
    snapshot: ClusterSnapshot
    endpoints: dict[str, Endpoint] = field(default_factory=dict)
    built_at: float = 0.0
    # instance id -> (wall time of the report its load comes from, its max running requests)
    reported: dict[str, tuple[float, float]] = field(default_factory=dict)
    # (P datacenter, MD datacenter) -> the KV format the WAN link asks P to send (WANLink
    # kv_format; absent: the engine's own)
    kv_formats: dict[tuple[str, str], str] = field(default_factory=dict)

    def main_block_sizes(self) -> set[int]:
        """The block sizes the MDs' prefix caches hash (0: an MD that does not say)."""
        return {st.block_tokens for st in self.snapshot.main_decode if st.block_tokens}


_LINK_STATUS = {
    FleetLinkStatus.UP: LinkStatus.UP,
    FleetLinkStatus.DEGRADED: LinkStatus.DEGRADED,
    FleetLinkStatus.DOWN: LinkStatus.DOWN,
}


def instance_reports() -> dict[tuple[int, str], tuple[dict[str, Any], dict[str, Any]]]:
    """(node id, instance id) -> (the node's latest report, its item for that instance).

    Keyed by the reporting node too: an instance is only ever read from its own node's report,
    so a node claiming another node's instance cannot steer that instance's traffic to itself
    (heartbeats already drop such claims; this holds even for a report published before that).
    """
    found: dict[tuple[int, str], tuple[dict[str, Any], dict[str, Any]]] = {}
    for entry in fleet_live.read_reports():
        for item in entry["report"].get("instances", []):
            found[(int(entry["node_id"]), str(item.get("instance_id")))] = (entry, item)
    return found


def _load(item: dict[str, Any]) -> tuple[float, int]:
    load = item.get("load") or {}
    running = float(load.get("running", 0))
    queued = int(load.get("queued", 0))
    capacity = _capacity(item)
    return ((running + queued) / capacity if capacity > 0 else 0.0), queued


def _capacity(item: dict[str, Any]) -> float:
    try:
        return float((item.get("load") or {}).get("max_running") or 0)
    except (TypeError, ValueError):
        return 0.0


@dataclass(frozen=True, slots=True)
class _InstanceRow:
    """What the live view needs of one instance's database rows (its node, datacenter, GPU)."""

    pk: int
    node_id: int
    role: str
    wanted: bool  # desired running, node online
    datacenter: str
    agent_endpoint: str
    interconnect_gbps: float | None


@dataclass(frozen=True, slots=True)
class _LinkRow:
    src: str
    dst: str
    bandwidth_gbps: float
    rtt_ms: float
    status: str
    kv_format: str = ""


def _load_topology(model_name: str) -> tuple[tuple[_InstanceRow, ...], tuple[_LinkRow, ...]]:
    rows = Instance.objects.select_related("node__datacenter", "node__gpu_type").filter(
        served_model__name=model_name
    )
    instances = tuple(
        _InstanceRow(
            pk=inst.pk,
            node_id=inst.node_id,
            role=inst.role,
            wanted=inst.desired_state == DesiredState.RUNNING
            and inst.node.status == NodeStatus.ONLINE,
            datacenter=inst.node.datacenter.name,
            agent_endpoint=inst.node.agent_endpoint,
            interconnect_gbps=(
                float(inst.node.gpu_type.interconnect_gbps or 0.0)
                if inst.node.gpu_type is not None
                else None
            ),
        )
        for inst in rows
    )
    links = tuple(
        _LinkRow(
            link.from_datacenter.name,
            link.to_datacenter.name,
            link.bandwidth_gbps,
            link.rtt_ms,
            link.status,
            link.kv_format,
        )
        for link in WANLink.objects.select_related("from_datacenter", "to_datacenter")
    )
    return instances, links


# The fleet's rows change rarely (an operator's edit, a node going offline); the reports that
# make an instance healthy or loaded change every heartbeat and are read on every build. The
# rows are kept until a save changes what the view uses (the "topology" counter,
# routing/caching.py): every process sees that within half a second.
topology = shared_cache("topology", capacity=256)
# Per model, the fields a view uses; a save touching none of them (a heartbeat's
# last_heartbeat_at / last_report, an instance's actual_state) changes nothing here.
_TOPOLOGY_FIELDS = {
    Instance: {"role", "node", "served_model", "desired_state"},
    Node: {"status", "agent_endpoint", "datacenter", "gpu_type"},
    WANLink: None,  # every field
    Datacenter: None,
    GPUType: {"interconnect_gbps"},
}
# (node, instance, report time) -> the KV in flight to an MD as a frozenset: a report's
# hashes are turned into a set once, not on every build.
_block_sets: TtlCache[frozenset[str]] = TtlCache(max_age_s=3600.0, capacity=4096)


def _incoming_blocks(item: dict[str, Any]) -> frozenset[str]:
    """The prefix blocks of the KV on its way to an MD (reserved there, not imported yet)."""
    return frozenset(item.get("incoming_prefix_blocks") or ())


def _block_tokens(item: dict[str, Any] | None) -> int:
    """Tokens per block of an instance's prefix cache, as its report says (``kv.block_size``);
    0 when it does not say (the served model's block size is assumed)."""
    size = ((item or {}).get("kv") or {}).get("block_size")
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else 0


def _topology_changed(sender, update_fields=None, **_: object) -> None:
    used = _TOPOLOGY_FIELDS.get(sender)
    if update_fields is not None and used is not None and not (set(update_fields) & used):
        return
    versions.bump("topology")


def connect_topology_invalidation() -> None:
    for model in _TOPOLOGY_FIELDS:
        uid = f"live-topology-{model.__name__}"
        post_save.connect(_topology_changed, sender=model, dispatch_uid=uid)
        post_delete.connect(_topology_changed, sender=model, dispatch_uid=uid)


def build_live_view(model_name: str) -> LiveView:
    """Instances serving `model_name`, healthy only when the operator wants them running, the
    node is online and the agent's fresh report says running."""
    reports = instance_reports()
    index = prefix_index()
    index.sync()  # the Redis index's new events into this process's mirror
    rows, link_rows = topology.get(model_name, lambda: _load_topology(model_name))
    states: list[InstanceState] = []
    endpoints: dict[str, Endpoint] = {}
    prefill_dcs: set[str] = set()
    link_use: dict[str, float] = {}
    # Expected wait for a WAN connection, only if an agent reports one (``pool_wait_s`` in
    # its ``links[peer]``); absent, the policy sees no pool queue (0), as before.
    link_wait: dict[str, float] = {}
    reported: dict[str, tuple[float, float]] = {}
    # MD datacenter -> the in-DC fabric bandwidth of its MD nodes (their GPUs' interconnect).
    main_fabric_gbps: dict[str, float] = {}
    for inst in rows:
        key = str(inst.pk)
        entry, item = reports.get((inst.node_id, key), (None, None))
        if entry is not None and item is not None:
            reported[key] = (float(entry.get("received_at") or 0.0), _capacity(item))
        dc = inst.datacenter
        healthy = item is not None and item.get("state") == "running" and inst.wanted
        load, queued = _load(item) if item is not None else (0.0, 0)
        # What MD holds: its radix cache (the prefix index, kept from its KV cache events)
        # and the KV in flight to it (reserved, on its way; the heartbeat's
        # ``incoming_prefix_blocks``), as its ``reserve`` counts it.
        cached: BlockSet = frozenset()
        if item is not None:
            incoming = _block_sets.get(
                (inst.node_id, key, reported[key][0]), functools.partial(_incoming_blocks, item)
            )
            cached = index.held(key, incoming)
        states.append(
            InstanceState(
                id=key,
                role=inst.role,
                datacenter=dc,
                healthy=healthy,
                load=load,
                queue_depth=queued,
                cached_prefix_blocks=cached,
                handoff_mode=(item or {}).get("handoff_mode"),
                block_tokens=_block_tokens(item) if inst.role == InstanceRole.MAIN_DECODE else 0,
            )
        )
        kv = (item or {}).get("kv_endpoint") or {}
        endpoints[key] = Endpoint(
            instance_id=key,
            role=inst.role,
            datacenter=dc,
            http=(entry or {}).get("endpoint") or inst.agent_endpoint,
            kv_host=str(kv.get("host", "")),
            kv_port=int(kv.get("port", 0) or 0),
            wan_port=int(kv.get("wan_port", 0) or 0),
        )
        if inst.role == InstanceRole.MAIN_DECODE and inst.interconnect_gbps is not None:
            gbps = inst.interconnect_gbps
            if gbps > 0:
                main_fabric_gbps[dc] = min(main_fabric_gbps.get(dc, gbps), gbps)
        if inst.role == InstanceRole.PREFILL:
            prefill_dcs.add(dc)
            for peer, link in ((entry or {}).get("report", {}).get("links") or {}).items():
                if isinstance(link, dict) and "utilisation" in link:
                    link_use[peer] = max(link_use.get(peer, 0.0), float(link["utilisation"]))
                if isinstance(link, dict) and "pool_wait_s" in link:
                    try:
                        wait = float(link["pool_wait_s"])
                    except (TypeError, ValueError):
                        continue
                    if wait > 0.0 and math.isfinite(wait):
                        link_wait[peer] = max(link_wait.get(peer, 0.0), wait)
    wan_links: dict[str, WanLinkState] = {}
    for link in link_rows:
        src, dst = link.src, link.dst
        if src in prefill_dcs:
            wan_links[dst] = WanLinkState(
                bandwidth_gbps=link.bandwidth_gbps,
                rtt_ms=link.rtt_ms,
                utilisation=min(1.0, link_use.get(dst, 0.0)),
                status=_LINK_STATUS.get(link.status, LinkStatus.DOWN),
                pool_wait_s=link_wait.get(dst, 0.0),
            )
    # An MD in a prefill datacenter (in-DC PD) is reached over the datacenter's own fabric, not a
    # WAN link: the policy sees that path as a fast, always-up link (the agents ship the KV over
    # their intra-DC fabric), so P-MD inside one datacenter is routable.
    for dc, gbps in main_fabric_gbps.items():
        if dc in prefill_dcs and dc not in wan_links:
            wan_links[dc] = WanLinkState(
                bandwidth_gbps=gbps, rtt_ms=IN_DC_RTT_MS, utilisation=0.0, status=LinkStatus.UP
            )
    return LiveView(
        snapshot=ClusterSnapshot.from_instances(states, wan_links),
        endpoints=endpoints,
        built_at=time.monotonic(),
        reported=reported,
        kv_formats={(link.src, link.dst): link.kv_format for link in link_rows if link.kv_format},
    )


REDIS_RETRY_S = 10.0  # how long the dispatch ledger counts locally after a Redis failure


class _RedisFallback:
    """A ledger's Redis upkeep: after a failure it skips Redis for REDIS_RETRY_S (no timeout
    on every request while Redis is down) and warns at most once a minute."""

    _name = "ledger"
    # redis.Redis when shared (its stubs type each reply as Awaitable | value: read as Any).
    _redis: Any = None
    _redis_down_until = 0.0
    _warned_at = 0.0

    def _connect(self, redis_url: str) -> None:
        """Redis with short timeouts when `redis_url` is set (a slow Redis must not hold a
        request up), else none: this process's memory only. After a failure Redis is skipped
        for a while (no timeout on every request while it is down)."""
        self._redis = None
        self._warned_at = 0.0
        self._redis_down_until = 0.0
        if redis_url:
            import redis

            self._redis = redis.Redis.from_url(
                redis_url, socket_connect_timeout=0.5, socket_timeout=0.5
            )

    def _use_redis(self) -> bool:
        return self._redis is not None and time.monotonic() >= self._redis_down_until

    def _redis_failed(self, what: str, exc: Exception) -> None:
        now = time.monotonic()
        self._redis_down_until = now + REDIS_RETRY_S
        if now - self._warned_at > 60:  # once a minute, not once a request
            self._warned_at = now
            log.warning(
                "%s: Redis %s failed (%s); counting this process's dispatches only",
                self._name, what, exc,
            )  # fmt: skip


class DispatchLedger(_RedisFallback):
    """Requests the gateway has routed to each instance, by wall time.

    An agent reports its load every couple of seconds, so every decision between two reports
    would see the same loads and pick the same least-loaded instance (a herd). The gateway
    therefore adds what it has routed to an instance since that instance's last report (see
    :func:`with_dispatches`). Entries older than ``horizon_s`` are forgotten.

    With ``redis_url`` the ledger is shared by every gateway process (a sorted set of dispatch
    times per instance), so several workers do not herd either. This process's own dispatches
    are always kept in memory as well: if Redis fails, the ledger logs it and counts those.
    """

    _name = "dispatch ledger"

    def __init__(
        self, horizon_s: float = 30.0, redis_url: str = "", *, prefix: str = "baton:dispatch"
    ) -> None:
        self.horizon_s = horizon_s
        self.prefix = prefix
        self._times: dict[str, deque[float]] = {}
        self._lock = threading.Lock()
        self._connect(redis_url)

    @property
    def shared(self) -> bool:
        return self._redis is not None

    def record(self, instance_ids: Iterable[str | None], now: float | None = None) -> None:
        now = time.time() if now is None else now
        ids = [iid for iid in instance_ids if iid]
        with self._lock:
            for iid in ids:
                times = self._times.setdefault(iid, deque())
                times.append(now)
                while times and times[0] < now - self.horizon_s:
                    times.popleft()
        if self._use_redis() and ids:
            try:
                pipe = self._redis.pipeline(transaction=False)
                for iid in ids:
                    key = f"{self.prefix}:{iid}"
                    pipe.zadd(key, {f"{now:.6f}:{uuid.uuid4().hex[:12]}": now})
                    pipe.zremrangebyscore(key, "-inf", now - self.horizon_s)
                    pipe.expire(key, int(self.horizon_s * 2) + 1)
                pipe.execute()
            except Exception as exc:  # noqa: BLE001 - any Redis failure: count locally
                self._redis_failed("record", exc)

    def since(self, instance_id: str, t: float) -> int:
        """Dispatches to ``instance_id`` after wall time ``t``."""
        return self.since_many([(instance_id, t)])[instance_id]

    def since_many(self, pairs: Iterable[tuple[str, float]]) -> dict[str, int]:
        """Dispatches to each instance after its wall time (one Redis round trip when shared)."""
        pairs = list(pairs)
        if self._use_redis() and pairs:
            try:
                pipe = self._redis.pipeline(transaction=False)
                for iid, t in pairs:
                    pipe.zcount(f"{self.prefix}:{iid}", f"({t}", "+inf")
                return {iid: int(n) for (iid, _), n in zip(pairs, pipe.execute(), strict=True)}
            except Exception as exc:  # noqa: BLE001 - any Redis failure: count locally
                self._redis_failed("count", exc)
        with self._lock:
            return {iid: self._local_since(iid, t) for iid, t in pairs}

    def _local_since(self, instance_id: str, t: float) -> int:
        # Caller holds the lock. Newest last: count back only until the first dispatch the
        # report already saw.
        times = self._times.get(instance_id, ())
        return sum(1 for _ in takewhile(lambda x: x > t, reversed(times)))

    def clear(self) -> None:
        with self._lock:
            ids = list(self._times)
            self._times.clear()
        if self._redis is not None and ids:
            try:
                self._redis.delete(*[f"{self.prefix}:{iid}" for iid in ids])
            except Exception as exc:  # noqa: BLE001
                self._redis_failed("clear", exc)


def with_dispatches(view: LiveView, ledger: DispatchLedger) -> ClusterSnapshot:
    """The view's snapshot with each instance's load raised by the requests this process routed
    to it after its last report (one running request per dispatch, over its capacity)."""
    snap = view.snapshot
    changed = False

    everything = (*snap.prefill, *snap.relay_decode, *snap.main_decode)
    counted = ledger.since_many(
        (st.id, view.reported[st.id][0])
        for st in everything
        if st.id in view.reported and view.reported[st.id][1] > 0
    )

    def adjusted(states: tuple[InstanceState, ...]) -> tuple[InstanceState, ...]:
        nonlocal changed
        out = []
        for st in states:
            _, capacity = view.reported.get(st.id, (0.0, 0.0))
            extra = counted.get(st.id, 0)
            if extra:
                changed = True
                st = replace(st, load=st.load + extra / capacity)
            out.append(st)
        return tuple(out)

    prefill = adjusted(snap.prefill)
    relay = adjusted(snap.relay_decode)
    main = adjusted(snap.main_decode)
    if not changed:
        return snap
    return ClusterSnapshot(
        prefill=prefill,
        relay_decode=relay,
        main_decode=main,
        wan_links=snap.wan_links,
        prefix_hits=snap.prefix_hits,
    )


DISPATCHED_BLOCKS_CAP = 65_536  # block hashes kept per MD (about 1.5 MB in Redis)
CONFIRM_GRACE_S = 2.0  # a report received this long after a dispatch holds its blocks


class DispatchedBlocks(_RedisFallback):
    """Prefix blocks of the prompts the gateway has sent to each MD, by wall time.

    MD's heartbeat reports the blocks its radix cache holds and those of the KV in flight to
    it (reserved at MD, not imported yet). A request the gateway has just dispatched is in
    neither until P's ``reserve`` reaches MD and MD's next heartbeat has gone out, so a
    session's next turn, sent right after the previous answer, would look like a miss and be
    relayed although MD will hold its prefix. The gateway therefore counts the blocks it
    dispatched to an MD since that MD's last report as held there
    (:func:`with_dispatched_blocks`), for every pipeline that ends on MD (p-md, p-rld-md).

    A report received more than ``grace_s`` after a dispatch confirms or drops it: by then
    MD's reservation (or its import) has put the blocks in the report, or the request failed.
    The grace covers the time from the gateway's dispatch to MD's reservation (the gateway
    calls P, P calls MD's ``reserve``, MD pins on its engine thread) and the time the report
    took to reach the control plane; counting a dispatch a little longer than needed only
    overlaps with what the report says. Entries older than ``horizon_s`` are dropped in any
    case, and at most ``cap`` hashes per MD are kept: the most recently dispatched, and of one
    prompt its leading blocks before its deeper ones.

    With ``redis_url`` every gateway process shares the ledger: one sorted set per MD, member
    a block hash, score its latest dispatch time. This process's own dispatches are kept in
    memory as well: if Redis fails, the ledger logs it and counts those, as
    :class:`DispatchLedger` does.
    """

    _name = "dispatched-blocks ledger"

    def __init__(
        self,
        horizon_s: float = 30.0,
        redis_url: str = "",
        *,
        prefix: str = "baton:dispatched-blocks",
        cap: int = DISPATCHED_BLOCKS_CAP,
        grace_s: float = CONFIRM_GRACE_S,
    ) -> None:
        if cap < 1:
            raise ValueError(f"cap must be >= 1, got {cap}")
        self.horizon_s = horizon_s
        self.prefix = prefix
        self.cap = cap
        self.grace_s = grace_s
        # instance id -> block hash -> latest dispatch time, least recently dispatched first
        self._blocks: dict[str, OrderedDict[str, float]] = {}
        self._lock = threading.Lock()
        self._connect(redis_url)

    @property
    def shared(self) -> bool:
        return self._redis is not None

    def record(
        self, instance_id: str | None, block_hashes: Sequence[str], now: float | None = None
    ) -> None:
        """The prompt with these prefix blocks was dispatched to MD ``instance_id`` at ``now``."""
        if not instance_id or not block_hashes:
            return
        now = time.time() if now is None else now
        oldest = now - self.horizon_s
        with self._lock:
            blocks = self._blocks.setdefault(instance_id, OrderedDict())
            # Deepest first, so a prompt's leading blocks (the ones a hit is made of) are the
            # last to go when the cap is reached.
            for block in reversed(block_hashes):
                blocks[block] = max(now, blocks.get(block, now))
                blocks.move_to_end(block)
            while blocks and (len(blocks) > self.cap or next(iter(blocks.values())) < oldest):
                blocks.popitem(last=False)
        if self._use_redis():
            key = f"{self.prefix}:{instance_id}"
            try:
                pipe = self._redis.pipeline(transaction=False)
                # GT: a new hash is added, a known one only moves forward in time. Each block
                # a microsecond before the one above it, so that the cap (by rank) drops a
                # prompt's deepest blocks first, as in memory.
                scores = {block: now - i * 1e-6 for i, block in enumerate(block_hashes)}
                pipe.zadd(key, scores, gt=True)
                pipe.zremrangebyscore(key, "-inf", f"({oldest}")
                pipe.zremrangebyrank(key, 0, -(self.cap + 1))
                pipe.expire(key, int(self.horizon_s * 2) + 1)
                pipe.execute()
            except Exception as exc:  # noqa: BLE001 - any Redis failure: count locally
                self._redis_failed("record", exc)

    def held(
        self, instance_id: str, block_hashes: Sequence[str], after: float, now: float | None = None
    ) -> int:
        """How many of ``block_hashes``, from the first, were dispatched to ``instance_id``
        after wall time ``after`` (and within the horizon)."""
        return self.held_many([(instance_id, after, block_hashes)], now=now)[instance_id]

    def held_many(
        self, queries: Iterable[tuple[str, float, Sequence[str]]], now: float | None = None
    ) -> dict[str, int]:
        """:meth:`held` for each (instance, after, hashes). Shared: one Redis round trip for
        every query's first hash, a second only for the instances that have it, so a request
        costs little on the MDs that never saw its prefix."""
        queries = [(iid, after, hashes) for iid, after, hashes in queries]
        now = time.time() if now is None else now
        oldest = now - self.horizon_s
        runs = {iid: 0 for iid, _, _ in queries}
        asked = [(iid, max(after, oldest), hashes) for iid, after, hashes in queries if hashes]
        if self._use_redis() and asked:
            try:
                pipe = self._redis.pipeline(transaction=False)
                for iid, _, hashes in asked:
                    pipe.zscore(f"{self.prefix}:{iid}", hashes[0])
                starts = pipe.execute()
                rest = [q for q, t in zip(asked, starts, strict=True) if t is not None and t > q[1]]
                if rest:
                    pipe = self._redis.pipeline(transaction=False)
                    for iid, _, hashes in rest:
                        pipe.zmscore(f"{self.prefix}:{iid}", list(hashes))
                    for (iid, cutoff, _), scores in zip(rest, pipe.execute(), strict=True):
                        runs[iid] = _run(t is not None and t > cutoff for t in scores)
                return runs
            except Exception as exc:  # noqa: BLE001 - any Redis failure: count locally
                self._redis_failed("lookup", exc)
        with self._lock:
            for iid, cutoff, hashes in asked:
                blocks = self._blocks.get(iid)
                if blocks:
                    runs[iid] = _run(blocks.get(h, -math.inf) > cutoff for h in hashes)
        return runs

    def clear(self) -> None:
        with self._lock:
            ids = list(self._blocks)
            self._blocks.clear()
        if self._redis is not None and ids:
            try:
                self._redis.delete(*[f"{self.prefix}:{iid}" for iid in ids])
            except Exception as exc:  # noqa: BLE001
                self._redis_failed("clear", exc)


def _run(flags: Iterable[bool]) -> int:
    """How many of ``flags``, from the first, are true."""
    n = 0
    for flag in flags:
        if not flag:
            break
        n += 1
    return n


def with_dispatched_blocks(
    view: LiveView,
    snapshot: ClusterSnapshot,
    ledger: DispatchedBlocks,
    block_hashes: Sequence[str],
    now: float | None = None,
    hashes_for: Callable[[InstanceState], Sequence[str]] | None = None,
) -> tuple[ClusterSnapshot, dict[str, int]]:
    """``snapshot`` with each MD's cached prefix blocks extended by this request's blocks that
    the gateways dispatched to that MD since its last report (less the ledger's grace), and,
    per MD, how many of the request's leading blocks only the ledger supplied.

    Only the request's own leading run is added (what the policy matches); the view's snapshot
    is not changed. An MD that has never reported counts every dispatch within the horizon.
    ``hashes_for``: the request's hashes in an MD's own block size (RequestInfo.hashes_for),
    when MDs hash blocks of other sizes than ``block_hashes``'."""
    if not block_hashes or not snapshot.main_decode or snapshot.prefix_hits is not None:
        return snapshot, {}
    queries: list[tuple[str, float, Sequence[str]]] = []
    held_from: dict[str, int] = {}
    own: dict[str, Sequence[str]] = {}
    for st in snapshot.main_decode:
        if not st.healthy:
            continue
        hashes = own[st.id] = block_hashes if hashes_for is None else hashes_for(st)
        k = leading_run(hashes, st.cached_prefix_blocks)
        if k == len(hashes):
            continue
        reported_at = view.reported.get(st.id, (0.0, 0.0))[0]
        held_from[st.id] = k
        queries.append((st.id, reported_at - ledger.grace_s, hashes[k:]))
    if not queries:
        return snapshot, {}
    runs = ledger.held_many(queries, now=now)
    added: dict[str, int] = {}
    main = []
    for st in snapshot.main_decode:
        run = runs.get(st.id, 0)
        if run:
            k, hashes = held_from[st.id], own[st.id]
            cached, end = st.cached_prefix_blocks, k + run
            # Past the dispatched run, MD's report may hold more (a deeper cached block).
            end += leading_run(hashes[end:], cached)
            added[st.id] = end - k
            st = replace(st, cached_prefix_blocks=cached.union(hashes[k:end]))
        main.append(st)
    if not added:
        return snapshot, {}
    return (
        ClusterSnapshot(
            prefill=snapshot.prefill,
            relay_decode=snapshot.relay_decode,
            main_decode=tuple(main),
            wan_links=snapshot.wan_links,
            prefix_hits=snapshot.prefix_hits,
        ),
        added,
    )


class LiveViewCache:
    """Per-process cache so a burst of requests shares one snapshot build."""

    def __init__(self, max_age_s: float = SNAPSHOT_MAX_AGE_S) -> None:
        self.max_age_s = max_age_s
        self._views: dict[str, LiveView] = {}
        self._lock = threading.Lock()

    def get(self, model_name: str) -> LiveView:
        now = time.monotonic()
        with self._lock:
            view = self._views.get(model_name)
            if view is not None and now - view.built_at < self.max_age_s:
                return view
        view = build_live_view(model_name)
        with self._lock:
            self._views[model_name] = view
        return view

    def clear(self) -> None:
        with self._lock:
            self._views.clear()


class SuspectInstances(_RedisFallback):
    """Instances a gateway saw fail (connection refused, a broken stream), by wall time.

    A suspect is routed around until its node sends a report newer than the failure: a dead
    instance stays avoided from the first failed request on, in every gateway process (Redis
    when ``redis_url`` is set), instead of until the node is marked offline several heartbeats
    later; a false alarm costs one heartbeat interval. Marks older than ``horizon_s`` are
    forgotten (by then a silent node is offline anyway).
    """

    _name = "suspect ledger"

    def __init__(
        self, horizon_s: float = 60.0, redis_url: str = "", *, prefix: str = "baton:suspect"
    ) -> None:
        self.horizon_s = horizon_s
        self.prefix = prefix
        self._marks: dict[str, float] = {}
        self._lock = threading.Lock()
        self._connect(redis_url)

    def mark(self, instance_ids: Iterable[str | None], now: float | None = None) -> None:
        now = time.time() if now is None else now
        ids = [str(i) for i in instance_ids if i]
        if not ids:
            return
        with self._lock:
            for instance_id in ids:
                self._marks[instance_id] = now
        if self._use_redis():
            try:
                pipe = self._redis.pipeline()
                pipe.hset(self.prefix, mapping={i: repr(now) for i in ids})
                pipe.expire(self.prefix, int(self.horizon_s) + 1)
                pipe.execute()
            except Exception as exc:  # noqa: BLE001 - Redis down: this process still avoids them
                self._redis_failed("write", exc)

    def marks(self, now: float | None = None) -> dict[str, float]:
        """instance id -> when it was last seen failing, within the horizon."""
        now = time.time() if now is None else now
        with self._lock:
            for key in [k for k, t in self._marks.items() if now - t > self.horizon_s]:
                del self._marks[key]
            found = dict(self._marks)
        if self._use_redis():
            try:
                for key, value in self._redis.hgetall(self.prefix).items():
                    at = float(value)
                    if now - at <= self.horizon_s:
                        name = key.decode() if isinstance(key, bytes) else str(key)
                        found[name] = max(found.get(name, 0.0), at)
            except Exception as exc:  # noqa: BLE001
                self._redis_failed("read", exc)
        return found

    def clear(self) -> None:
        with self._lock:
            self._marks.clear()
        if self._use_redis():
            try:
                self._redis.delete(self.prefix)
            except Exception as exc:  # noqa: BLE001
                self._redis_failed("clear", exc)


_suspects: SuspectInstances | None = None
_suspects_lock = threading.Lock()


def suspect_ledger() -> SuspectInstances:
    """This process's view of the suspect instances (shared through Redis when set): the
    gateway marks what it saw failing, the agent probe (routing/probes.py) what it found dead."""
    global _suspects
    with _suspects_lock:
        if _suspects is None:
            _suspects = SuspectInstances(
                redis_url=settings.REDIS_URL, prefix=f"{settings.REDIS_KEY_PREFIX}:suspect"
            )
        return _suspects


def without_suspects(
    view: LiveView, snapshot: ClusterSnapshot, ledger: SuspectInstances
) -> tuple[ClusterSnapshot, list[str]]:
    """``snapshot`` with every instance marked suspect after its last report made unhealthy,
    and the ids it made so."""
    marks = ledger.marks()
    if not marks:
        return snapshot, []
    avoided: list[str] = []

    def adjusted(states: tuple[InstanceState, ...]) -> tuple[InstanceState, ...]:
        out = []
        for st in states:
            marked = marks.get(st.id)
            reported_at = view.reported.get(st.id, (0.0, 0.0))[0]
            if marked is not None and st.healthy and marked >= reported_at:
                st = replace(st, healthy=False)
                avoided.append(st.id)
            out.append(st)
        return tuple(out)

    if not any(
        st.id in marks for st in (*snapshot.prefill, *snapshot.relay_decode, *snapshot.main_decode)
    ):
        return snapshot, []
    result = replace(
        snapshot,
        prefill=adjusted(snapshot.prefill),
        relay_decode=adjusted(snapshot.relay_decode),
        main_decode=adjusted(snapshot.main_decode),
    )
    return result, avoided
