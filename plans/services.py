"""Capacity planning over the fleet in the database: the planner's inputs built from fleet rows,
and plan runs (create, execute) that the REST API, the Celery task and `manage.py plan` share;
``python -m planner size --from-db`` starts from the same fleet (``planner_fleet_from_db``).

The planner (``planner/``) knows nothing of Django. Hardware, prices, datacenters and the WAN
link come from the database; the model, engine, workload, SLA and routing policy come from a
bundled scenario, because the served models in the database (e.g. ``baton-tiny``) carry none of
the cost figures the planner needs (active parameters, attention FLOPs, decode weight bytes).
"""

from __future__ import annotations

import copy
import itertools
import logging
import math
from collections import Counter
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any, TypeVar

from django.db import models
from django.db.models import Sum
from django.utils import timezone

from fleet.choices import InstanceRole, LinkStatus, PlanRunStatus
from fleet.dispatch import enqueue_after_commit
from fleet.models import Datacenter, GPUType, Instance, Node, UnitPrice, WANLink
from pdd.hardware import unit_from_chips
from plans.models import PlanRun

log = logging.getLogger(__name__)
# A PlanRun or a SizingRun (enqueue_run, execute_run).
RunT = TypeVar("RunT", bound=models.Model)

DEFAULT_SCENARIO = "tiny-plan"
DEFAULT_GPUS_PER_NODE = 8
MAX_COUNT = 1000
MAX_COMBINATIONS = 64
MAX_TOP = 20
# A scenario without a search_space (only tiny-plan has one) is searched with the planner's
# own defaults; hi_rps is raised to twice the scenario's offered load when that is higher.
DEFAULT_SEARCH = {"lo_rps": 1.0, "hi_rps": 100.0, "iters": 5}
# The Celery name of the task that runs a plan (plans/tasks.py): the one of the days when plan
# runs lived in ``fleet``, so runs queued before an upgrade still reach the new workers.
PLAN_EXECUTE = "fleet.plan_execute"
COUNT_FIELDS = (
    ("prefill_counts", InstanceRole.PREFILL),
    ("relay_counts", InstanceRole.RELAY_DECODE),
    ("main_counts", InstanceRole.MAIN_DECODE),
)


class PlanInputError(ValueError):
    """Bad planning input; ``field`` names what is wrong (a request field, or ``fleet``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


# --- scenarios ------------------------------------------------------------------------------


def plan_scenarios() -> list[tuple[str, str]]:
    """(name, description) of the bundled scenarios a plan can take its model and load from."""
    from planner.scenario import list_scenarios, load_scenario

    return [(n, d) for n, d in list_scenarios() if load_scenario(n)["kind"] == "fleet"]


def scenario_config(scenario: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The scenario's case config to plan with (its PDD case if it has one) and search settings."""
    from planner.scenario import case_configs, load_scenario

    names = [name for name, _ in plan_scenarios()]
    # Only bundled names: load_scenario also takes file paths, which a request must not reach.
    if scenario not in names:
        raise PlanInputError(
            "scenario", f"unknown scenario {scenario!r}; choose one of {', '.join(names)}"
        )
    data = load_scenario(scenario)
    configs = case_configs(data)
    config = next(
        (c for c in configs.values() if c.get("fleet", {}).get("system") == "pdd"),
        next(iter(configs.values())),
    )
    search = {k: v for k, v in data.get("search_space", {}).items() if k != "pools"}
    if not search:
        rps = float(config.get("workload", {}).get("rps", 0) or 0)
        search = {**DEFAULT_SEARCH, "hi_rps": max(DEFAULT_SEARCH["hi_rps"], 2 * rps)}
    search.setdefault("warmup_s", float(config.get("warmup_s", 60.0)))
    return config, search


def scenario_default_counts(scenario: str) -> dict[str, list[int]]:
    """The counts a scenario's own search space tries, by count field (empty if it has none)."""
    from planner.scenario import load_scenario

    scenario_config(scenario)  # validates the name
    pools = load_scenario(scenario).get("search_space", {}).get("pools", [])
    by_role = {p.get("role"): list(p.get("counts", [])) for p in pools}
    return {field: by_role.get(role, []) for field, role in COUNT_FIELDS}


def plan_counts_check(field: str, counts: Sequence[int] | None) -> list[int]:
    """Node counts to try for one role: non-empty, integers in 0..1000; sorted, no repeats."""
    if not counts:
        raise PlanInputError(field, "needs at least one node count")
    for c in counts:
        if isinstance(c, bool) or not isinstance(c, int) or not 0 <= c <= MAX_COUNT:
            raise PlanInputError(field, f"counts must be whole numbers 0..{MAX_COUNT}, got {c!r}")
    return sorted(set(counts))


# --- the fleet from the database -------------------------------------------------------------


def _gpus_per_node(gpu_type: GPUType) -> int:
    """The most common GPU count of the nodes of this type (ties: the larger); 8 if none."""
    counts = Counter(Node.objects.filter(gpu_type=gpu_type).values_list("gpu_count", flat=True))
    if not counts:
        return DEFAULT_GPUS_PER_NODE
    return max(counts.items(), key=lambda kv: (kv[1], kv[0]))[0]


def _wan_link(notes: list[str], chosen: WANLink | None = None) -> WANLink:
    """The link planned over: `chosen` when given (the autopilot's served model's), else the
    first that is up."""
    if chosen is not None:
        links = [chosen]
        if chosen.status != LinkStatus.UP:
            notes.append(f"WAN link {_link_name(chosen)} is {chosen.status}; planned as if up")
        if chosen.rtt_ms <= 0:
            raise PlanInputError("fleet", f"WAN link {_link_name(chosen)} has rtt_ms 0; the "
                                 "planner needs a positive round-trip time")  # fmt: skip
        return chosen
    links = list(WANLink.objects.select_related("from_datacenter", "to_datacenter"))
    if not links:
        raise PlanInputError(
            "fleet", "no WAN link in the database; add one at /api/v1/wan-links/ (from = the "
            "prefill datacenter, to = the main-decode datacenter)"
        )  # fmt: skip
    up = [link for link in links if link.status == LinkStatus.UP]
    link = up[0] if up else links[0]
    if len(links) > 1:
        notes.append(
            f"{len(links)} WAN links; planning over {_link_name(link)}, the first "
            + ("that is up" if up else "(none is up)")
        )
    elif not up:
        notes.append(f"WAN link {_link_name(link)} is {link.status}; planned as if it were up")
    if link.rtt_ms <= 0:
        raise PlanInputError("fleet", f"WAN link {_link_name(link)} has rtt_ms 0; the planner "
                             "needs a positive round-trip time")  # fmt: skip
    return link


def _link_name(link: WANLink) -> str:
    return f"{link.from_datacenter.name} -> {link.to_datacenter.name}"


def _priced_gpu(
    datacenter: Datacenter, at: datetime, purpose: str, notes: list[str]
) -> tuple[GPUType, UnitPrice]:
    """The GPU type a datacenter's pools use: priced there now, most GPUs installed there."""
    prices: dict[int, UnitPrice] = {}
    for price in (
        UnitPrice.objects.effective_at(at)
        .filter(datacenter=datacenter)
        .select_related("gpu_type")
        .order_by("-effective_from")
    ):
        prices.setdefault(price.gpu_type_id, price)  # the latest start wins an overlap
    if not prices:
        raise PlanInputError(
            "fleet",
            f"no GPU type has a unit price in force in datacenter {datacenter.name} (the "
            f"{purpose} end of the WAN link) at {at.isoformat(timespec='minutes')}; add one at "
            "/api/v1/unit-prices/",
        )
    installed = dict(
        Node.objects.filter(datacenter=datacenter, gpu_type_id__in=prices)
        .order_by()
        .values_list("gpu_type_id")
        .annotate(total=Sum("gpu_count"))
    )
    ranked = sorted(
        prices.values(),
        key=lambda p: (-installed.get(p.gpu_type_id, 0), p.gpu_type.vendor, p.gpu_type.model),
    )
    chosen = ranked[0]
    if len(ranked) > 1:
        notes.append(
            f"{len(ranked)} GPU types are priced in {datacenter.name}; using "
            f"{chosen.gpu_type} (most GPUs installed there)"
        )
    return chosen.gpu_type, chosen


def _gpu_spec(gpu: GPUType, price: UnitPrice, per_node: int) -> dict[str, Any]:
    """One planner unit (a node of ``per_node`` GPUs) in the planner's units."""
    unit = unit_from_chips(
        name=str(gpu),
        count=per_node,
        peak_bf16_tflops=gpu.peak_bf16_tflops,
        memory_gib=gpu.memory_gib,
        memory_bandwidth_gbps=gpu.memory_bandwidth_gbps,
        interconnect_gbps=gpu.interconnect_gbps,
        unit_price=float(price.price_per_gpu_hour) * per_node,
    )
    return {
        "peak_tflops": unit.peak_tflops,
        "mem_gb": unit.mem_gb,
        "mem_bw_tbps": unit.mem_bw_tbps,
        "interconnect_gbps": unit.interconnect_gbps,
        "unit_price": unit.unit_price,
        "_source": (
            f"fleet.GPUType #{gpu.pk} {gpu} x {per_node} GPUs per node; "
            f"UnitPrice #{price.pk} {price.price_per_gpu_hour} {price.currency}/GPU-h"
        ),
    }


def plan_inputs_from_fleet(
    *,
    scenario: str = DEFAULT_SCENARIO,
    prefill_counts: Sequence[int],
    relay_counts: Sequence[int],
    main_counts: Sequence[int],
    duration_s: float | None = None,
    at: datetime | None = None,
    link: WANLink | None = None,
) -> dict[str, Any]:
    """The planner's arguments for the fleet in the database, as one JSON-ready dict.

    P and RLD pools sit at the WAN link's from end, MD at its to end (the first link that is
    up, if there are several). Each pool uses the GPU type priced in that datacenter at ``at``
    (default now) with the most GPUs installed there; a planner unit is one node of that type,
    sized by the most common ``gpu_count`` of its nodes (8 if it has none), priced at the unit
    price x GPUs per node. Counts are nodes. ``duration_s`` shortens the simulated workload.
    Raises PlanInputError (a ValueError) naming the field or the missing fleet data.
    """
    config, search = scenario_config(scenario)
    counts = {
        field: plan_counts_check(field, value)
        for field, value in (
            ("prefill_counts", prefill_counts),
            ("relay_counts", relay_counts),
            ("main_counts", main_counts),
        )
    }
    sizes = [len(c) for c in counts.values()]
    if math.prod(sizes) > MAX_COMBINATIONS:
        raise PlanInputError(
            "counts",
            f"{' x '.join(map(str, sizes))} = {math.prod(sizes)} combinations of prefill, "
            f"relay and main counts; at most {MAX_COMBINATIONS}",
        )
    if max(counts["prefill_counts"]) == 0 or max(counts["main_counts"]) == 0:
        field = "prefill_counts" if max(counts["prefill_counts"]) == 0 else "main_counts"
        raise PlanInputError(field, "a servable fleet needs at least one node; add a count > 0")
    at = at or timezone.now()
    notes = [
        "model, engine, workload, SLA and policy come from scenario "
        f"{scenario!r}: the served models in the database carry no planner cost figures",
        "counts are nodes; GPU interconnect (GB/s per GPU) stands in for the planner's RDMA NIC "
        "bandwidth (Gbit/s per node), which only the P -> RLD fabric transfer uses",
    ]
    link = _wan_link(notes, link)
    p_dc, md_dc = link.from_datacenter, link.to_datacenter
    p_gpu, p_price = _priced_gpu(p_dc, at, "prefill", notes)
    md_gpu, md_price = _priced_gpu(md_dc, at, "main-decode", notes)
    if p_price.currency != md_price.currency:
        raise PlanInputError(
            "fleet",
            f"unit prices in {p_dc.name} are in {p_price.currency} but in {md_dc.name} in "
            f"{md_price.currency}; BCR needs one currency",
        )
    per_node = {p_gpu.pk: _gpus_per_node(p_gpu), md_gpu.pk: _gpus_per_node(md_gpu)}
    p_name, md_name = f"{p_gpu.vendor}/{p_gpu.model}", f"{md_gpu.vendor}/{md_gpu.model}"
    if p_name == md_name and p_price.price_per_gpu_hour != md_price.price_per_gpu_hour:
        # The planner prices a GPU type, not a (type, datacenter) pair: split the name.
        p_name, md_name = f"{p_name}@{p_dc.name}", f"{md_name}@{md_dc.name}"

    fleet_spec = copy.deepcopy(config["fleet"])
    scenario_links = [v for k, v in fleet_spec.get("links", {}).items() if not k.startswith("_")]
    link_spec = {
        k: v
        for k, v in (scenario_links[0] if scenario_links else {}).items()
        if k in ("per_connection_gbps", "tcp_window_kb")
    }
    fleet_spec.update(
        system="pdd",  # the database topology is PDD: P and RLD at one end, MD at the other
        gpu_types={
            p_name: _gpu_spec(p_gpu, p_price, per_node[p_gpu.pk]),
            md_name: _gpu_spec(md_gpu, md_price, per_node[md_gpu.pk]),
        },
        links={
            md_dc.name: {
                **link_spec,
                "bandwidth_gbps": link.bandwidth_gbps,
                "rtt_ms": link.rtt_ms,
                "pool_size": link.connection_pool_size,
                "_source": f"fleet.WANLink #{link.pk} {_link_name(link)}; per-connection "
                f"window from scenario {scenario!r}",
            }
        },
        pools=[],
    )
    pool_place = {
        InstanceRole.PREFILL: (p_name, p_dc.name),
        InstanceRole.RELAY_DECODE: (p_name, p_dc.name),
        InstanceRole.MAIN_DECODE: (md_name, md_dc.name),
    }
    search_space = {
        **search,
        "pools": [
            {
                "role": str(role),
                "gpu": pool_place[role][0],
                "datacenter": pool_place[role][1],
                "counts": counts[field],
            }
            for field, role in COUNT_FIELDS
        ],
    }
    workload = copy.deepcopy(config.get("workload", {}))
    if duration_s is not None:
        if not duration_s > search["warmup_s"]:
            raise PlanInputError(
                "duration_s", f"must be longer than the warmup ({search['warmup_s']:g} s)"
            )
        workload["duration_s"] = duration_s
    return {
        "scenario": scenario,
        **counts,
        "currency": p_price.currency,
        "priced_at": at.isoformat(),
        "gpus_per_node": {
            "prefill": per_node[p_gpu.pk],
            "relay_decode": per_node[p_gpu.pk],
            "main_decode": per_node[md_gpu.pk],
        },
        "fleet_spec": fleet_spec,
        # Where each role's pool is in the database: its datacenter and GPU type (the
        # autopilot starts instances there).
        "places": {
            str(role): {
                "datacenter": dc.pk,
                "gpu_type": gpu.pk,
                "gpus_per_node": per_node[gpu.pk],
                "gpu": name,
                "pool": f"{role}@{dc.name}:{name}",
            }
            for role, (name, dc, gpu) in {
                InstanceRole.PREFILL: (p_name, p_dc, p_gpu),
                InstanceRole.RELAY_DECODE: (p_name, p_dc, p_gpu),
                InstanceRole.MAIN_DECODE: (md_name, md_dc, md_gpu),
            }.items()
        },
        "workload_spec": workload,
        "sla": copy.deepcopy(config.get("sla", {})),
        "search_space": search_space,
        "notes": notes,
    }


def planner_fleet_from_db(scenario: str) -> dict[str, Any]:
    """The fleet in the database as a planner fleet (GPU types, prices, WAN link from the
    inventory, model and engine from ``scenario``), its pool counts the nodes now running each
    role (at least one prefill and one main-decode node)."""
    nodes = {
        role: Instance.objects.filter(role=role).values("node").distinct().count()
        for _, role in COUNT_FIELDS
    }
    inputs = plan_inputs_from_fleet(
        scenario=scenario,
        prefill_counts=[max(nodes[InstanceRole.PREFILL], 1)],
        relay_counts=[nodes[InstanceRole.RELAY_DECODE]],
        main_counts=[max(nodes[InstanceRole.MAIN_DECODE], 1)],
    )
    fleet = inputs["fleet_spec"]
    fleet["pools"] = [
        {k: p[k] for k in ("role", "gpu", "datacenter")} | {"count": p["counts"][0]}
        for p in inputs["search_space"]["pools"]
    ]
    fleet["_source"] = "; ".join(inputs["notes"])
    return fleet


# --- running a search ------------------------------------------------------------------------


def finite_json(value: Any) -> Any:
    """``value`` with every NaN and infinity, at any depth, as None: JSON has none
    (PostgreSQL's jsonb refuses them), so a figure that has no value is stored as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite_json(v) for v in value]
    return value


def plan_inputs_run(
    *,
    inputs: dict[str, Any],
    top: int,
    on_progress: Callable[[int, int], None] | None = None,
) -> list[dict[str, Any]]:
    """Run the planner on ``inputs`` (from plan_inputs_from_fleet); best ``top`` results.

    One planner call per combination, so progress can be reported between them; the ranking
    is the planner's own (best BCR first, then the cheaper).
    """
    from planner.api import plan

    pools = inputs["search_space"]["pools"]
    combos = list(itertools.product(*(p["counts"] for p in pools)))
    if on_progress:
        on_progress(0, len(combos))
    found = []
    for done, combo in enumerate(combos, start=1):
        one = {
            **inputs["search_space"],
            "pools": [{**p, "counts": [c]} for p, c in zip(pools, combo, strict=True)],
        }
        found.extend(plan(inputs["fleet_spec"], inputs["workload_spec"], inputs["sla"], one, 1))
        if on_progress:
            on_progress(done, len(combos))
    found.sort(key=lambda r: (-r.bcr, r.cost_per_hour))
    per_node = inputs.get("gpus_per_node", {})
    out = []
    for result in found[:top]:
        row = result.to_dict()
        nodes = {str(role): 0 for _, role in COUNT_FIELDS}
        for key, count in result.counts.items():
            nodes[key.split("@", 1)[0]] += count
        row["nodes"] = nodes
        row["gpus"] = {role: n * per_node.get(role, 0) for role, n in nodes.items()}
        out.append(finite_json(row))
    return out


def plan_run_create(
    *,
    scenario: str = DEFAULT_SCENARIO,
    prefill_counts: Sequence[int],
    relay_counts: Sequence[int],
    main_counts: Sequence[int],
    top: int = 5,
    created_by=None,
    duration_s: float | None = None,
) -> PlanRun:
    """Record a queued plan over the fleet as it is now; a worker runs it after commit.

    The inputs are built here, so a plan against missing fleet data fails at once (as a
    PlanInputError) and a queued run keeps the fleet it was asked about.
    """
    if isinstance(top, bool) or not isinstance(top, int) or not 1 <= top <= MAX_TOP:
        raise PlanInputError("top", f"must be a whole number 1..{MAX_TOP}, got {top!r}")
    inputs = plan_inputs_from_fleet(
        scenario=scenario,
        prefill_counts=prefill_counts,
        relay_counts=relay_counts,
        main_counts=main_counts,
        duration_s=duration_s,
    )
    total = math.prod(len(p["counts"]) for p in inputs["search_space"]["pools"])
    run = PlanRun.objects.create(
        scenario=scenario,
        top=top,
        inputs=finite_json(inputs),
        progress_total=total,
        created_by=created_by if getattr(created_by, "is_authenticated", False) else None,
    )
    enqueue_run(PLAN_EXECUTE, PlanRun, run.pk, "the plan")
    return run


def enqueue_run(task: str, model: type[models.Model], pk: int, what: str) -> None:
    """Queue ``task`` for the queued run ``pk`` of ``model`` (a PlanRun or a SizingRun) once
    the transaction commits. One that cannot be queued is marked failed, saying why: a queued
    run nobody will start is worse than a failed one."""

    def failed(exc: Exception) -> None:
        model._default_manager.filter(pk=pk, status=PlanRunStatus.QUEUED).update(
            status=PlanRunStatus.FAILED,
            error=f"could not queue {what}: {type(exc).__name__}: {exc}",
            finished_at=timezone.now(),
        )

    enqueue_after_commit(task, pk, on_error=failed)


def execute_run(
    model: type[RunT], pk: int, what: str, work: Callable[[RunT], dict[str, Any]]
) -> RunT | None:
    """Run the queued run ``pk`` of ``model`` (a PlanRun or a SizingRun) to done or failed:
    ``work(run)`` computes it and returns the fields a done run gets. Only a queued run
    starts, so a repeated or concurrent call changes nothing; returns the run as it now
    stands (None if deleted)."""
    rows = model._default_manager.filter(pk=pk)
    started = rows.filter(status=PlanRunStatus.QUEUED).update(
        status=PlanRunStatus.RUNNING, started_at=timezone.now(), progress_done=0
    )
    if not started:
        return rows.first()
    run = rows.get()
    try:
        done = work(run)
    except Exception as exc:  # includes Celery's SoftTimeLimitExceeded
        log.warning("%s %s failed", what, pk, exc_info=True)
        rows.update(
            status=PlanRunStatus.FAILED,
            error=f"{type(exc).__name__}: {exc}",
            finished_at=timezone.now(),
        )
    else:
        rows.update(status=PlanRunStatus.DONE, finished_at=timezone.now(), **done)
    run.refresh_from_db()
    return run


def plan_run_execute(*, plan_run_id: int) -> PlanRun | None:
    """Run a queued plan to done or failed (execute_run)."""

    def progress(done: int, total: int) -> None:
        PlanRun.objects.filter(pk=plan_run_id).update(progress_done=done, progress_total=total)

    def work(run: PlanRun) -> dict[str, Any]:
        return {"results": plan_inputs_run(inputs=run.inputs, top=run.top, on_progress=progress)}

    return execute_run(PlanRun, plan_run_id, "plan", work)
