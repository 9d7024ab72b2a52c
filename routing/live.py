"""The live picture the policy decides on: healthy instances with their load and cached
prefixes (from agents' heartbeats, shared through fleet.live) and the WAN links, cached per
process (``LiveViewCache``). What this gateway adds to it before a decision is elsewhere: its
own dispatches (``routing.dispatches``) and the instances seen failing (``routing.suspects``)."""

from __future__ import annotations

import functools
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from django.db.models.signals import post_delete, post_save

from fleet import live as fleet_live
from fleet.choices import DesiredState, InstanceRole, NodeStatus
from fleet.choices import LinkStatus as FleetLinkStatus
from fleet.kv_index import prefix_index
from fleet.models import Datacenter, GPUType, Instance, Node, WANLink
from pdd.kv_formats import KV_FORMATS, wire_factor
from pdd.policy import (
    BlockSet,
    ClusterSnapshot,
    InstanceState,
    LinkStatus,
    WanLinkState,
)
from routing.caching import TtlCache, shared_cache, versions

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
    # instance id -> its report's age (s), for an instance the operator wants running on an
    # online node whose last report said running but is late: past the fresh age, within the
    # late one (fleet/live.py). Unhealthy in the snapshot; a request with no path only for
    # them waits for their next report (routes.route_first).
    late: dict[str, float] = field(default_factory=dict)

    def main_block_sizes(self) -> set[int]:
        """The block sizes the MDs' prefix caches hash (0: an MD that does not say)."""
        return {st.block_tokens for st in self.snapshot.main_decode if st.block_tokens}


_LINK_STATUS = {
    FleetLinkStatus.UP: LinkStatus.UP,
    FleetLinkStatus.DEGRADED: LinkStatus.DEGRADED,
    FleetLinkStatus.DOWN: LinkStatus.DOWN,
}


def instance_reports(
    max_age_s: float | None = None,
) -> dict[tuple[int, str], tuple[dict[str, Any], dict[str, Any]]]:
    """(node id, instance id) -> (the node's latest report, its item for that instance).

    Keyed by the reporting node too: an instance is only ever read from its own node's report,
    so a node claiming another node's instance cannot steer that instance's traffic to itself
    (heartbeats already drop such claims; this holds even for a report published before that).
    """
    found: dict[tuple[int, str], tuple[dict[str, Any], dict[str, Any]]] = {}
    for entry in fleet_live.read_reports(max_age_s=max_age_s):
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


def _kv_dtype(item: dict[str, Any] | None) -> str:
    """The dtype an instance's KV is held in, as its report says (``kv.dtype``; before agents
    reported it, the engine's ``dtype``); "" when unknown."""
    if not item:
        return ""
    got = ((item.get("kv") or {}).get("dtype")) or item.get("dtype") or ""
    return got if got in KV_FORMATS else ""


def _wire_factor(kv_format: str, own: str) -> float:
    """Bytes on the wire per byte of the engines' KV on a link of ``kv_format``: 1.0 for the
    engines' own, or when the senders' dtype is not known (the policy stays conservative)."""
    if not kv_format or not own or kv_format not in KV_FORMATS:
        return 1.0
    return wire_factor(kv_format, own)


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
    fresh_s = fleet_live.fresh_age_s()
    reports = instance_reports(max_age_s=fleet_live.late_age_s())
    now = time.time()
    late: dict[str, float] = {}
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
    # Prefill datacenter -> the KV dtype its P instances report (the first one's): what a
    # link's transport format is relative to, for the bytes a transfer puts on the wire.
    prefill_kv_dtype: dict[str, str] = {}
    for inst in rows:
        key = str(inst.pk)
        entry, item = reports.get((inst.node_id, key), (None, None))
        if entry is not None and now - float(entry.get("received_at") or 0.0) > fresh_s:
            # Late, not fresh: nothing of it is used; noted when it may yet come back.
            if item is not None and item.get("state") == "running" and inst.wanted:
                late[key] = round(now - float(entry.get("received_at") or 0.0), 3)
            entry, item = None, None
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
            own = _kv_dtype(item)
            if own:
                prefill_kv_dtype.setdefault(dc, own)
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
                wire_factor=_wire_factor(link.kv_format, prefill_kv_dtype.get(src, "")),
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
        late=late,
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
