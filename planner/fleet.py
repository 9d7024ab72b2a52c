"""The fleet a simulation runs: chips, model, engines, pools per role and datacenter, links.

Built from plain dicts (scenario files, the REST API) by :func:`fleet_from_dict`; every error
names the path of the bad field.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pdd.hardware import EngineSpec, GpuType, ModelSpec
from pdd.policy import PolicySettings, Role
from pdd.spec import build, check_bool, check_int, check_positive
from pdd.vocab import HandoffMode, Pipeline
from planner.host import HostSpec
from planner.wan import WanLinkSpec


class System:
    """Which serving design the fleet runs."""

    IDC_PD = "idc-pd"  # one datacenter, P and D in one RDMA domain
    CDC_PD = "cdc-pd"  # P in A, MD in B with a decode-side prefix cache, no relay
    PDD = "pdd"  # P-MD / P-RLD-MD via pdd.policy.decide
    P_RLD = Pipeline.P_RLD.value  # like PDD, low-hit requests finish on RLD (the excluded design)

    CHOICES = (IDC_PD, CDC_PD, PDD, P_RLD)


class Handoff:
    ADAPTIVE = "adaptive"  # switched by RLD load, as the policy settings say
    ONE_SHOT = HandoffMode.ONE_SHOT.value
    CATCH_UP = HandoffMode.CATCH_UP.value

    CHOICES = (ADAPTIVE, ONE_SHOT, CATCH_UP)


@dataclass(slots=True)
class Pool:
    role: str
    gpu: str
    count: int
    datacenter: str

    def __post_init__(self) -> None:
        if self.role not in Role.CHOICES:
            raise ValueError(f"role: must be one of {', '.join(Role.CHOICES)}, got {self.role!r}")
        check_int(self, "count", 0)
        for name in ("gpu", "datacenter"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"{name}: must be a non-empty string, got {getattr(self, name)!r}")


@dataclass(slots=True)
class FabricSpec:
    """Intra-datacenter RDMA fabric: latency plus bytes over the slower end's NIC.

    ``relay_latency_ms`` / ``relay_gbps``, when set, price P's handoff to RLD in a P-RLD-MD
    request instead: there P exports the KV twice (for RLD and, the delta, for MD) and ships
    both at once, which the testbed's agents measure as a costlier handoff than a plain one
    (None: the plain latency and the slower end's interconnect, as for any handoff)."""

    latency_ms: float = 0.5
    relay_latency_ms: float | None = None
    relay_gbps: float | None = None

    def __post_init__(self) -> None:
        check_positive(self, "latency_ms")
        for name in ("relay_latency_ms", "relay_gbps"):
            if getattr(self, name) is not None:
                check_positive(self, name)
        if self.relay_latency_ms is not None and self.relay_gbps is None:
            raise ValueError("relay_latency_ms: needs relay_gbps too (a relay's bandwidth)")


@dataclass(slots=True)
class FleetSpec:
    system: str
    gpu_types: dict[str, GpuType]
    model: ModelSpec
    pools: list[Pool]
    links: dict[str, WanLinkSpec] = field(default_factory=dict)  # keyed by MD datacenter
    engine: EngineSpec = field(default_factory=EngineSpec)
    fabric: FabricSpec = field(default_factory=FabricSpec)
    policy: PolicySettings = field(default_factory=PolicySettings)
    handoff: str = Handoff.ADAPTIVE
    resident_weight_gb: float = 400.0  # weights resident on each decode unit
    drc_capacity_gb: float = 1000.0  # decode-side prefix cache (HBM + host DRAM) per MD unit
    # Whether the policy is told the WAN connection pool's expected wait
    # (WanLinkState.pool_wait_s). Off by default, as in the live gateway: agents do not report a
    # pool wait, so routing/live.py decides with 0 (link utilisation and bandwidth only), which is
    # also PDD's published rule (relay the low-hit requests whose delta is heavy). True is a
    # what-if: the gateway told each link's connection queue.
    pool_wait_aware: bool = False
    # Whether an MD's prefix match counts KV already on its way to it (P committed to send it
    # for an earlier turn): the next turn then sends only what is new and MD waits for the
    # earlier KV to land before using it. False: only landed KV counts, so a turn sent while the
    # previous turn's KV is still in flight (its relay answered first) resends that context.
    drc_counts_in_flight: bool = True
    # Whether the routing decision itself sees the KV in flight to an MD as held there. True
    # models the live gateway as it now is: it decides on MD's heartbeat blocks, radix cache and
    # KV in flight (``incoming_prefix_blocks``), plus the prompts dispatched to MD since
    # (routing/live.py ``DispatchedBlocks``), so such a turn may go P-MD and wait for the
    # earlier KV to land. False (still the default, until paper-ttft's cases and
    # bench/planner/REPORT.md are rerun with True: on paper-ttft's pdd case True gives P90
    # 7.65 s as False does and P99 15.67 s against 14.98 s) is the gateway as it was, on landed
    # KV only: a turn whose predecessor's KV is still crossing the WAN looks low-hit and is
    # relayed, and with ``drc_counts_in_flight`` its delta to MD still counts that KV.
    decision_counts_in_flight: bool = False
    # Whether a relayed request's KV transfer to MD yields the WAN connection queue to the
    # transfers a first token waits on (P-MD). Its user is already answered by RLD, so delaying
    # it costs RLD a longer hold, not TTFT. On, as the agents do (agents/transfer/pool.py).
    relay_transfers_yield: bool = True
    # Whether a session's context lives on one prefill unit, as on the live fleet: its turns go
    # to that P (its home, by session id as MD's warm-start home is) whatever that P's queue,
    # since the live policy picks the P with the longest cached prefix and a P's load there
    # is its slots, not its backlog. False (the default, what the planner's reports were made
    # with): the least backlogged P is chosen and still holds every session's prefix.
    prefill_affinity: bool = False
    # Which unit of a pool holds a session's context when the run starts (its home, for a
    # session already under way; ``session_home``): None, the session id modulo the pool's
    # size; a string, a hash of that string and the id, the rule a live benchmark that warmed
    # its fleet's caches by it used (bench/paper), so the prediction starts where it started.
    session_home_salt: str | None = None
    # Every instance on one machine whose cores they share (``planner.host``: the live testbed,
    # one-thread CPU engines and the gateway on a few cores). None: each instance has its own
    # chip, as in a real fleet.
    host: HostSpec | None = None

    def __post_init__(self) -> None:
        if self.system not in System.CHOICES:
            raise ValueError(f"system: must be one of {', '.join(System.CHOICES)}")
        if self.handoff not in Handoff.CHOICES:
            raise ValueError(f"handoff: must be one of {', '.join(Handoff.CHOICES)}")
        for i, pool in enumerate(self.pools):
            if pool.gpu not in self.gpu_types:
                raise ValueError(f"pools[{i}].gpu: unknown GPU type {pool.gpu!r}")
            if (
                self.system != System.IDC_PD
                and pool.role == Role.MAIN_DECODE
                and pool.count
                and pool.datacenter not in self.links
            ):
                raise ValueError(f"pools[{i}].datacenter: no WAN link to {pool.datacenter!r}")
        if not any(p.role == Role.PREFILL and p.count for p in self.pools):
            raise ValueError("pools: need at least one prefill unit")
        if not any(p.role == Role.MAIN_DECODE and p.count for p in self.pools):
            raise ValueError("pools: need at least one main_decode (decode) unit")
        for name in (
            "pool_wait_aware",
            "relay_transfers_yield",
            "drc_counts_in_flight",
            "decision_counts_in_flight",
            "prefill_affinity",
        ):
            check_bool(self, name)
        if self.session_home_salt is not None and not isinstance(self.session_home_salt, str):
            raise ValueError("session_home_salt: must be a string or null")
        if self.host is not None and not isinstance(self.host, HostSpec):
            raise ValueError("host: must be an object (cores, request_cpu_s) or null")
        check_positive(self, "resident_weight_gb")
        check_positive(self, "drc_capacity_gb")
        read = self.model.decode_weight_gb + self.model.decode_expert_gb
        if read > self.resident_weight_gb + 1e-9:
            raise ValueError(
                f"model.decode_weight_gb + model.decode_expert_gb: {read:g} GB exceeds "
                f"resident_weight_gb {self.resident_weight_gb:g} (a decode unit reads only "
                "weights it holds)"
            )

    def units(self, role: str | None = None) -> int:
        return sum(p.count for p in self.pools if role is None or p.role == role)

    def cost_per_hour(self) -> float:
        return sum(p.count * self.gpu_types[p.gpu].unit_price for p in self.pools)


def session_home(salt: str | None, session: int, units: int) -> int:
    """The index of the unit (of ``units``) holding a session's context when a run starts:
    ``session % units`` without a salt, else a stable hash of ``salt`` and the id."""
    if salt is None:
        return session % units
    digest = hashlib.blake2b(f"{salt}{session}".encode(), digest_size=4).hexdigest()
    return int(digest, 16) % units


def fleet_from_dict(data: Mapping[str, Any]) -> FleetSpec:
    if not isinstance(data, Mapping):
        raise ValueError("fleet: must be an object")
    data = {k: v for k, v in data.items() if not str(k).startswith("_")}
    try:
        gpu_types = {
            name: build(
                GpuType,
                {"name": name, **_obj(spec, f"fleet.gpu_types.{name}")},
                f"fleet.gpu_types.{name}",
            )
            for name, spec in _obj(data.pop("gpu_types"), "fleet.gpu_types").items()
            if not name.startswith("_")
        }
        model = data.pop("model")
        pools = data.pop("pools")
    except KeyError as exc:
        raise ValueError(f"fleet.{exc.args[0]}: required") from None
    if not isinstance(pools, list):
        raise ValueError("fleet.pools: must be a list")
    links = {
        dc: build(WanLinkSpec, spec, f"fleet.links.{dc}")
        for dc, spec in _obj(data.pop("links", {}), "fleet.links").items()
        if not dc.startswith("_")
    }
    host = data.pop("host", None)
    policy = data.pop("policy", {})
    try:
        policy_settings = PolicySettings.from_dict(
            {k: v for k, v in _obj(policy, "fleet.policy").items() if not k.startswith("_")}
        )
    except ValueError as exc:
        raise ValueError(f"fleet.policy.{exc}") from exc
    return build(
        FleetSpec,
        {
            **data,
            "gpu_types": gpu_types,
            "model": build(
                ModelSpec, {"name": "model", **_obj(model, "fleet.model")}, "fleet.model"
            ),
            "pools": [build(Pool, p, f"fleet.pools[{i}]") for i, p in enumerate(pools)],
            "links": links,
            "engine": build(EngineSpec, data.get("engine", {}), "fleet.engine"),
            "fabric": build(FabricSpec, data.get("fabric", {}), "fleet.fabric"),
            "policy": policy_settings,
            "host": None if host is None else build(HostSpec, host, "fleet.host"),
        },
        "fleet",
    )


def _obj(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise ValueError(f"{where}: must be an object")
    return dict(value)
