"""The live picture the policy decides on: healthy instances with their load and cached
prefixes (from agents' heartbeats, shared through fleet.live) and the WAN links."""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from fleet import live as fleet_live
from fleet.choices import DesiredState, InstanceRole, NodeStatus
from fleet.choices import LinkStatus as FleetLinkStatus
from fleet.models import Instance, WANLink
from routing.policy import ClusterSnapshot, InstanceState, LinkStatus, WanLinkState

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


_LINK_STATUS = {
    FleetLinkStatus.UP: LinkStatus.UP,
    FleetLinkStatus.DEGRADED: LinkStatus.DEGRADED,
    FleetLinkStatus.DOWN: LinkStatus.DOWN,
}


def _instance_reports() -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    found: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {}
    for entry in fleet_live.read_reports():
        for item in entry["report"].get("instances", []):
            found[str(item.get("instance_id"))] = (entry, item)
    return found


def _load(item: dict[str, Any]) -> tuple[float, int]:
    load = item.get("load") or {}
    running = float(load.get("running", 0))
    queued = int(load.get("queued", 0))
    capacity = float(load.get("max_running") or 0)
    return ((running + queued) / capacity if capacity > 0 else 0.0), queued


def build_live_view(model_name: str) -> LiveView:
    """Instances serving `model_name`, healthy only when the operator wants them running, the
    node is online and the agent's fresh report says running."""
    reports = _instance_reports()
    states: list[InstanceState] = []
    endpoints: dict[str, Endpoint] = {}
    prefill_dcs: set[str] = set()
    link_use: dict[str, float] = {}
    # Expected wait for a WAN connection, only if an agent reports one (``pool_wait_s`` in
    # its ``links[peer]``); absent, the policy sees no pool queue (0), as before.
    link_wait: dict[str, float] = {}
    rows = Instance.objects.select_related("node__datacenter").filter(served_model__name=model_name)
    for inst in rows:
        key = str(inst.pk)
        entry, item = reports.get(key, (None, None))
        dc = inst.node.datacenter.name
        healthy = (
            item is not None
            and item.get("state") == "running"
            and inst.desired_state == DesiredState.RUNNING
            and inst.node.status == NodeStatus.ONLINE
        )
        load, queued = _load(item) if item is not None else (0.0, 0)
        cached = (
            frozenset(item.get("cached_prefix_blocks") or ()) if item is not None else frozenset()
        )
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
            )
        )
        kv = (item or {}).get("kv_endpoint") or {}
        endpoints[key] = Endpoint(
            instance_id=key,
            role=inst.role,
            datacenter=dc,
            http=(entry or {}).get("endpoint") or inst.node.agent_endpoint,
            kv_host=str(kv.get("host", "")),
            kv_port=int(kv.get("port", 0) or 0),
            wan_port=int(kv.get("wan_port", 0) or 0),
        )
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
    for link in WANLink.objects.select_related("from_datacenter", "to_datacenter"):
        src, dst = link.from_datacenter.name, link.to_datacenter.name
        if src in prefill_dcs:
            wan_links[dst] = WanLinkState(
                bandwidth_gbps=link.bandwidth_gbps,
                rtt_ms=link.rtt_ms,
                utilisation=min(1.0, link_use.get(dst, 0.0)),
                status=_LINK_STATUS.get(link.status, LinkStatus.DOWN),
                pool_wait_s=link_wait.get(dst, 0.0),
            )
    return LiveView(
        snapshot=ClusterSnapshot.from_instances(states, wan_links),
        endpoints=endpoints,
        built_at=time.monotonic(),
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
