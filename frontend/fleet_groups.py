"""The fleet page at any size: instances grouped by datacenter -> role -> GPU type.

Each group carries its counts (instances, nodes, GPUs), its health (instances per actual state,
nodes offline), its load (running / max running, queued, mean KV use, from each instance's last
heartbeat) and its cost per hour (running instances' GPUs x the unit price in force, as the
fleet's headline cost). The page draws the groups, not the instances; the drill-down lists the
instances of one group (or of any filter on datacenter, role, GPU type, state, engine), a page
at a time.

An instance's engine kind (``torch``, or ``emulated`` for an agent that emulates its engine) is
read defensively from its part of the state document:
``frontend.telemetry.fleet.engine_kind``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any
from urllib.parse import urlencode

from django import forms
from django.utils import timezone

from fleet.choices import ActualState, InstanceRole, NodeStatus
from frontend.telemetry.fleet import ENGINE_EMULATED, engine_kind, instance_load

# The order states are counted, drawn and listed in: serving first, then on the way in or
# out, then the ones an operator must look at.
STATES = [
    ActualState.RUNNING,
    ActualState.PENDING,
    ActualState.STARTING,
    ActualState.DRAINING,
    ActualState.DRAINED,
    ActualState.STOPPED,
    ActualState.UNAVAILABLE,
    ActualState.FAILED,
]
ROLES = [InstanceRole.PREFILL, InstanceRole.RELAY_DECODE, InstanceRole.MAIN_DECODE]
ROLE_ORDER = {role.value: i for i, role in enumerate(ROLES)}
ROLE_SHORT = {
    InstanceRole.PREFILL.value: "P",
    InstanceRole.RELAY_DECODE.value: "RLD",
    InstanceRole.MAIN_DECODE.value: "MD",
}


@dataclass(slots=True)
class Row:
    """One instance as the fleet page shows it."""

    id: int
    role: str
    model: str
    node_id: int
    node: str
    node_status: str
    datacenter: str
    gpu_type: str
    gpu_count: int
    desired_state: str
    actual_state: str
    engine: str
    load: dict[str, Any]
    price: float | None  # per GPU-hour, in force now; None: no price
    currency: str

    @property
    def emulated(self) -> bool:
        return self.engine == ENGINE_EMULATED

    @property
    def role_display(self) -> str:
        return InstanceRole(self.role).label if self.role in ROLE_ORDER else self.role

    @property
    def role_short(self) -> str:
        return ROLE_SHORT.get(self.role, self.role)

    @property
    def running_text(self) -> str:
        running, cap = self.load.get("running"), self.load.get("max_running")
        return "–" if running is None else f"{running}/{cap}"

    @property
    def utilisation_pct(self) -> float:
        u = self.load.get("utilisation")
        return 0.0 if u is None else round(min(1.0, u) * 100, 1)


@dataclass
class Group:
    """Instances sharing datacenter, role and GPU type; an empty key part means any (totals)."""

    datacenter: str = ""
    role: str = ""
    gpu_type: str = ""
    instances: int = 0
    gpus: int = 0
    emulated: int = 0
    node_ids: set[int] = field(default_factory=set)
    offline_node_ids: set[int] = field(default_factory=set)
    states: dict[str, int] = field(default_factory=lambda: {s.value: 0 for s in STATES})
    running: int = 0
    max_running: int = 0
    queued: int = 0
    reporting: int = 0  # instances whose heartbeat carried load figures
    kv_sum: float = 0.0
    kv_n: int = 0
    cost: float = 0.0
    currencies: set[str] = field(default_factory=set)
    unpriced: int = 0  # running instances without a price in force

    def add(self, row: Row) -> None:
        self.instances += 1
        self.gpus += row.gpu_count
        self.emulated += row.emulated
        self.node_ids.add(row.node_id)
        if row.node_status == NodeStatus.OFFLINE:
            self.offline_node_ids.add(row.node_id)
        self.states[row.actual_state] = self.states.get(row.actual_state, 0) + 1
        load = row.load
        if load.get("running") is not None:
            self.reporting += 1
            self.running += load["running"]
            self.max_running += load.get("max_running") or 0
        self.queued += load.get("queued") or 0
        if load.get("kv_usage") is not None:
            self.kv_sum += load["kv_usage"]
            self.kv_n += 1
        if row.price is not None:
            self.currencies.add(row.currency)
        if row.actual_state == ActualState.RUNNING:
            if row.price is None:
                self.unpriced += 1
            else:
                self.cost += row.gpu_count * row.price

    # --- what the templates read ---------------------------------------------------------

    @property
    def key(self) -> str:
        return f"{self.datacenter}|{self.role}|{self.gpu_type}"

    @property
    def nodes(self) -> int:
        return len(self.node_ids)

    @property
    def nodes_offline(self) -> int:
        return len(self.offline_node_ids)

    @property
    def role_short(self) -> str:
        return ROLE_SHORT.get(self.role, self.role)

    @property
    def role_display(self) -> str:
        return InstanceRole(self.role).label if self.role in ROLE_ORDER else self.role

    @property
    def label(self) -> str:
        """``dc-a · P · gpu-a``; the parts a totals row leaves open are left out."""
        parts = [self.datacenter, self.role_short, self.gpu_type]
        return " · ".join(p for p in parts if p) or "whole fleet"

    @property
    def filters(self) -> dict[str, str]:
        return {
            k: v
            for k, v in (
                ("datacenter", self.datacenter),
                ("role", self.role),
                ("gpu_type", self.gpu_type),
            )
            if v
        }

    @property
    def query(self) -> str:
        """The drill-down's query string for this group (``all=1``: the whole fleet)."""
        return urlencode(self.filters or {"all": "1"})

    def state_cells(self) -> list[tuple[str, int, str]]:
        """(state, count, drill-down query) in ``STATES`` order."""
        return [
            (s.value, self.states.get(s.value, 0), urlencode({**self.filters, "state": s.value}))
            for s in STATES
        ]

    @property
    def states_text(self) -> str:
        """``20 running · 2 starting · 1 failed``: the states with instances in them."""
        parts = [f"{n} {s}" for s, n, _ in self.state_cells() if n]
        return " · ".join(parts) or "no instances"

    @property
    def emulated_query(self) -> str:
        return urlencode({**self.filters, "engine": ENGINE_EMULATED})

    @property
    def utilisation(self) -> float | None:
        return self.running / self.max_running if self.max_running else None

    @property
    def utilisation_pct(self) -> float:
        u = self.utilisation
        return 0.0 if u is None else round(min(1.0, u) * 100, 1)

    @property
    def load_text(self) -> str:
        return f"{self.running}/{self.max_running}" if self.reporting else "–"

    @property
    def kv_mean(self) -> float | None:
        return self.kv_sum / self.kv_n if self.kv_n else None

    @property
    def kv_text(self) -> str:
        kv = self.kv_mean
        return "–" if kv is None else f"{kv * 100:.1f}%"

    @property
    def cost_text(self) -> str:
        """``136.00 USD``; ``–`` where no price is in force (``unpriced`` counts those
        running)."""
        currency = ",".join(sorted(self.currencies))
        return f"{self.cost:.2f} {currency}" if currency else "–"


def fleet_rows(*, when: datetime | None = None) -> list[Row]:
    """Every instance with its node, datacenter, GPU type, engine kind, load and price."""
    from fleet.models import Instance, UnitPrice

    when = when or timezone.now()
    prices: dict[tuple[int, int], tuple[float, str]] = {}
    for price in UnitPrice.objects.effective_at(when):
        prices[(price.gpu_type_id, price.datacenter_id)] = (
            float(price.price_per_gpu_hour),
            price.currency,
        )
    qs = Instance.objects.select_related(
        "node", "node__datacenter", "node__gpu_type", "served_model"
    ).order_by("id")
    rows = []
    for inst in qs:
        node = inst.node
        report = inst.last_report if isinstance(inst.last_report, dict) else {}
        price = prices.get((node.gpu_type_id, node.datacenter_id))
        rows.append(
            Row(
                id=inst.pk,
                role=inst.role,
                model=inst.served_model.name,
                node_id=node.pk,
                node=node.hostname,
                node_status=node.status,
                datacenter=node.datacenter.name,
                gpu_type=node.gpu_type.model,
                gpu_count=inst.gpu_count,
                desired_state=inst.desired_state,
                actual_state=inst.actual_state,
                engine=engine_kind(report, node.last_report, inst.served_model.source),
                load=instance_load(report),
                price=price[0] if price else None,
                currency=price[1] if price else "",
            )
        )
    return rows


def _sort_key(row_or_group) -> tuple:
    return (row_or_group.datacenter, ROLE_ORDER.get(row_or_group.role, 9), row_or_group.gpu_type)


def groups_of(rows: Iterable[Row]) -> list[Group]:
    """One group per (datacenter, role, GPU type) with instances, datacenter then role (P, RLD,
    MD) then GPU type."""
    out: dict[tuple[str, str, str], Group] = {}
    for row in rows:
        key = (row.datacenter, row.role, row.gpu_type)
        group = out.get(key)
        if group is None:
            group = out[key] = Group(datacenter=key[0], role=key[1], gpu_type=key[2])
        group.add(row)
    return sorted(out.values(), key=_sort_key)


def totals_of(rows: list[Row]) -> list[Group]:
    """Totals across groups: one per role and one per GPU type that spans more than one group
    (a total of one group would repeat its row), then the whole fleet (none without rows)."""
    by_role: dict[str, Group] = {}
    by_gpu: dict[str, Group] = {}
    spans: dict[tuple[str, str], set[tuple[str, str, str]]] = {}
    fleet = Group()
    for row in rows:
        by_role.setdefault(row.role, Group(role=row.role)).add(row)
        by_gpu.setdefault(row.gpu_type, Group(gpu_type=row.gpu_type)).add(row)
        fleet.add(row)
        group = (row.datacenter, row.role, row.gpu_type)
        spans.setdefault(("role", row.role), set()).add(group)
        spans.setdefault(("gpu", row.gpu_type), set()).add(group)
    roles = sorted(
        (g for g in by_role.values() if len(spans[("role", g.role)]) > 1),
        key=lambda g: (ROLE_ORDER.get(g.role, 9), g.role),
    )
    gpus = sorted(
        (g for g in by_gpu.values() if len(spans[("gpu", g.gpu_type)]) > 1),
        key=lambda g: g.gpu_type,
    )
    return [*roles, *gpus, fleet] if rows else []


class FleetFilter(forms.Form):
    """The drill-down's filters; every field optional, an unknown value matches nothing."""

    datacenter = forms.CharField(required=False, max_length=64)
    role = forms.ChoiceField(required=False, choices=[("", "any role")] + InstanceRole.choices)
    gpu_type = forms.CharField(required=False, max_length=128)
    state = forms.ChoiceField(required=False, choices=[("", "any state")] + ActualState.choices)
    engine = forms.CharField(required=False, max_length=32)
    all = forms.BooleanField(required=False)  # no filter: every instance, a page at a time


def filtered(rows: Iterable[Row], filters: dict[str, str]) -> list[Row]:
    """The rows matching every filter given (``state`` is the actual state)."""
    fields = {
        "datacenter": "datacenter",
        "role": "role",
        "gpu_type": "gpu_type",
        "state": "actual_state",
        "engine": "engine",
    }
    wanted = {attr: filters[name] for name, attr in fields.items() if filters.get(name)}
    return [r for r in rows if all(getattr(r, a) == v for a, v in wanted.items())]


def price_map(rows: Iterable[Row]) -> dict[str, list]:
    """``"datacenter|gpu type" -> [price per GPU-hour, currency]`` for the page's live cost."""
    return {
        f"{r.datacenter}|{r.gpu_type}": [r.price, r.currency] for r in rows if r.price is not None
    }
