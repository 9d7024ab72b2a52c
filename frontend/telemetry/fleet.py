"""What the dashboard reads from fleet rows: cost per hour, instance load, links, placement."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.utils import timezone

from fleet.choices import ActualState
from fleet.models import Instance, UnitPrice, WANLink
from pdd.profiles import is_profile_source


@dataclass(slots=True)
class FleetState:
    """One read of the fleet: enough to price it, draw it and resolve WAN bytes to links."""

    cost_per_hour: float
    currency: str
    unpriced_instances: list[int]
    instances: list[dict[str, Any]]
    links: list[dict[str, Any]]
    # instance id (as records spell it) -> datacenter name
    instance_dc: dict[str, str] = field(default_factory=dict)
    # (from dc, to dc) -> link name
    link_by_dcs: dict[tuple[str, str], str] = field(default_factory=dict)

    def link_of(self, pairs) -> dict[tuple[str, str], str]:
        """Map (prefill instance, main instance) pairs of WAN counters to link names."""
        out: dict[tuple[str, str], str] = {}
        for src, dst in pairs:
            a, b = self.instance_dc.get(src), self.instance_dc.get(dst)
            name = None
            if a is not None and b is not None:
                name = self.link_by_dcs.get((a, b)) or self.link_by_dcs.get((b, a))
            out[(src, dst)] = name or "unresolved"
        return out

    def link_bandwidth(self) -> dict[str, float]:
        return {link["name"]: link["bandwidth_gbps"] for link in self.links}


def link_name(from_dc: str, to_dc: str) -> str:
    return f"{from_dc}->{to_dc}"


ENGINE_TORCH = "torch"
ENGINE_EMULATED = "emulated"


def engine_kind(report: Any, node_report: Any = None, source: str = "") -> str:
    """The engine kind of an instance: ``emulated`` or ``torch`` (the default).

    Read defensively from the instance's part of the state document: ``"engine_kind"``, or
    ``"engine"`` when it is a string or an object with a ``"kind"`` (today ``engine`` is the
    engine's stats object, which names no kind); failing those, the node's
    ``engine_options.engine``; failing those (no heartbeat yet), the served model's source: a
    model profile (``profile:...``) runs emulated. Anything missing or malformed is ``torch``."""
    options = node_report.get("engine_options") if isinstance(node_report, dict) else None
    for doc in (report, options):
        if not isinstance(doc, dict):
            continue
        engine = doc.get("engine")
        for value in (
            doc.get("engine_kind"),
            engine.get("kind") if isinstance(engine, dict) else engine,
        ):
            if isinstance(value, str) and value.strip():
                return value.strip().lower()
    if isinstance(source, str) and is_profile_source(source):
        return ENGINE_EMULATED
    return ENGINE_TORCH


def instance_load(report: dict[str, Any]) -> dict[str, Any]:
    """Load figures of an instance from its last heartbeat (agents/PROTOCOL.md)."""
    load = report.get("load") or {}
    kv = report.get("kv") or {}
    cache = report.get("cache") or {}
    running, cap = load.get("running"), load.get("max_running")
    used, total = kv.get("used_blocks"), kv.get("total_blocks")
    queried, matched = cache.get("queried_tokens"), cache.get("matched_tokens")
    return {
        "running": running,
        "queued": load.get("queued"),
        "max_running": cap,
        "utilisation": (running / cap) if running is not None and cap else None,
        "kv_usage": (used / total) if used is not None and total else None,
        "cache_hit_rate": (matched / queried) if matched is not None and queried else None,
    }


def fleet_cost_per_hour(*, when: datetime | None = None) -> tuple[float, str, list[int]]:
    """Sum over running instances of GPUs x the unit price in force for their node's GPU type
    and datacenter. Returns (cost per hour, currency, ids of running instances without a price).
    """
    when = when or timezone.now()
    prices: dict[tuple[int, int], UnitPrice] = {}
    for price in UnitPrice.objects.effective_at(when):
        prices[(price.gpu_type_id, price.datacenter_id)] = price
    total = 0.0
    currencies: set[str] = set()
    unpriced: list[int] = []
    # Four columns, not the rows: a node's and an instance's stored reports are large JSON.
    running = Instance.objects.filter(actual_state=ActualState.RUNNING).values_list(
        "pk", "gpu_count", "node__gpu_type_id", "node__datacenter_id"
    )
    for pk, gpu_count, gpu_type_id, datacenter_id in running:
        price = prices.get((gpu_type_id, datacenter_id))
        if price is None:
            unpriced.append(pk)
            continue
        total += gpu_count * float(price.price_per_gpu_hour)
        currencies.add(price.currency)
    currency = ",".join(sorted(currencies)) if currencies else "USD"
    return total, currency, unpriced


def fleet_state(*, when: datetime | None = None, instances: bool = True) -> FleetState:
    """The fleet's cost, instances and WAN links. ``instances=False`` leaves the instance list
    empty (each one's load and engine come from its stored report, large JSON at a thousand
    nodes) and keeps only where each instance is (``instance_dc``, for ``link_of``): what
    /metrics needs."""
    cost, currency, unpriced = fleet_cost_per_hour(when=when)
    listed: list[dict[str, Any]] = []
    instance_dc: dict[str, str] = {}
    if instances:
        rows = Instance.objects.select_related(
            "node", "node__datacenter", "node__gpu_type", "served_model"
        )
    else:
        rows = Instance.objects.none()
        instance_dc = {
            str(pk): dc for pk, dc in Instance.objects.values_list("pk", "node__datacenter__name")
        }
    for inst in rows:
        dc = inst.node.datacenter.name
        instance_dc[str(inst.pk)] = dc
        listed.append(
            {
                "id": inst.pk,
                "role": inst.role,
                "model": inst.served_model.name,
                "node": inst.node.hostname,
                "node_id": inst.node_id,
                "datacenter": dc,
                "gpu_type": inst.node.gpu_type.model,
                "gpu_count": inst.gpu_count,
                "desired_state": inst.desired_state,
                "actual_state": inst.actual_state,
                "load": instance_load(inst.last_report or {}),
                "engine": engine_kind(
                    inst.last_report, inst.node.last_report, inst.served_model.source
                ),
            }
        )
    links = []
    link_by_dcs: dict[tuple[str, str], str] = {}
    for link in WANLink.objects.select_related("from_datacenter", "to_datacenter"):
        a, b = link.from_datacenter.name, link.to_datacenter.name
        name = link_name(a, b)
        link_by_dcs[(a, b)] = name
        links.append(
            {
                "id": link.pk,
                "name": name,
                "from": a,
                "to": b,
                "bandwidth_gbps": link.bandwidth_gbps,
                "rtt_ms": link.rtt_ms,
                "status": link.status,
            }
        )
    return FleetState(
        cost_per_hour=cost,
        currency=currency,
        unpriced_instances=unpriced,
        instances=listed,
        links=links,
        instance_dc=instance_dc,
        link_by_dcs=link_by_dcs,
    )
