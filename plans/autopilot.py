"""The autopilot: the planner sizes the live fleet from live traffic and prices, an operator
approves (or the automatic mode, within guardrails), and Celery applies.

A **proposal** (``proposal_create``, then ``proposal_execute`` on a worker):

1. reads the live profile (plans/profile.py) over the settings' window;
2. builds the planner's fleet from the database (GPU types, unit prices, WAN link; counts =
   nodes running each role now) and sizes the cheapest fleet meeting the SLA at the profile's
   rate (``planner.size.size``, the workload's lengths and hit rates from the profile), kept at
   or above the settings' floors per role;
3. simulates the running and the proposed fleet at that rate (``planner.size.figures``: P90 /
   P99 TTFT, goodput, cost per hour, BCR) and the proposed one under a few routing thresholds
   (relay threshold, handoff-mode switch), proposing the best;
4. turns the difference into steps: start an instance of role R on a free node of the pool's
   datacenter and GPU type (most free GPUs first), or drain one (newest first), and says why.

**Approval** (``proposal_decide``): an operator approves or rejects a ``proposed`` one; one
whose fleet changed since it was made (``fingerprint``) is refused as stale. The automatic mode
(``autopilot_tick``) approves the newest proposal itself when the guardrails allow: not during a
fault (a node offline, an instance failed or unavailable, an apply under way), not within the
cool-down of the last apply, not above the budget per hour, and at most
``max_change_per_step`` changes (the rest waits for the next proposal).

**Apply** (``proposal_apply``, run by the tick and right after approval): starts first, each
to ``running``; then drains, each to ``drained`` (the agent finishes its in-flight requests
first), and only then is the drained instance removed; the thresholds last. Every step is saved
before and after its side effect in one transaction, so a worker that dies mid-way leaves
nothing done twice, and the next tick carries on. Every step is an event on the fleet's
timeline (``autopilot.*``).

**Honesty loop** (``record_realised``): after apply, the tick records the realised P90 / P99
TTFT and cost per hour of each window beside the predicted ones.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable
from datetime import timedelta
from decimal import Decimal
from typing import Any

from django.db import transaction
from django.db.models import Count
from django.utils import timezone

from fleet.choices import ActualState, DesiredState, NodeStatus
from fleet.dispatch import enqueue_after_commit
from fleet.events import event_record
from fleet.models import Instance, Node, ServedModel, WANLink
from fleet.services import instance_create, instance_delete, instance_set_desired_state
from plans.models import AutopilotSettings, Proposal, ProposalStatus, ProposalStep
from plans.profile import arrived_at, quantiles, workload_overrides, workload_profile
from plans.services import COUNT_FIELDS, PlanInputError, finite_json, plan_inputs_from_fleet

log = logging.getLogger(__name__)

PROPOSE = "plans.autopilot_propose"
APPLY = "plans.autopilot_apply"
ACTOR = "autopilot"
ROLES = [str(role) for _, role in COUNT_FIELDS]
DEFAULT_FLOORS = {"prefill": 1, "relay_decode": 0, "main_decode": 1}
# A start not running (or a drain not drained) after this long fails its step.
STEP_TIMEOUT_S = 600.0
# The realised figures are recorded per window of this many seconds after apply, this many.
REALISED_WINDOW_S = 300
REALISED_WINDOWS = 3
# A window's figures are taken this long after it ends, so the requests that arrived in it
# have been answered (they are counted by arrival: a queue the applied fleet inherited from
# before the apply is not its own doing).
REALISED_SETTLE_S = 60
# Relay thresholds tried around the policy's (factors), and handoff switches (catch-up below,
# one-shot above: RLD load).
THRESHOLD_FACTORS = (0.5, 1.0, 2.0)
HANDOFF_SWITCHES = ((0.5, 0.8), (0.25, 0.5))
SIZE_MAX_COUNT = 256


class ProposalRefused(Exception):
    """A decision the proposal's state does not allow; ``stale`` when its fleet changed."""

    def __init__(self, message: str, *, stale: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.stale = stale


# --- settings and the fleet ------------------------------------------------------------------


def settings_get() -> AutopilotSettings:
    row, _ = AutopilotSettings.objects.get_or_create(pk=1, defaults={"floors": DEFAULT_FLOORS})
    return row


def floors_of(row: AutopilotSettings) -> dict[str, int]:
    floors = dict(DEFAULT_FLOORS)
    for role, value in (row.floors or {}).items():
        if role in floors:
            floors[role] = int(value)
    return floors


def check_floors(value: Any) -> dict[str, int]:
    """The floors as given (a JSON object role -> count >= 0), or ValueError naming the role."""
    if not isinstance(value, dict):
        raise ValueError("must be an object of role -> fewest nodes")
    out = {}
    for role, count in value.items():
        if role not in DEFAULT_FLOORS:
            raise ValueError(f"unknown role {role!r}; roles: {', '.join(DEFAULT_FLOORS)}")
        if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= 1000:
            raise ValueError(f"{role}: must be an integer from 0 to 1000, got {count!r}")
        out[role] = count
    return out


def fleet_fingerprint() -> str:
    """What a proposal was made for: every instance (role, node, desired state) and the nodes
    online. Heartbeats and loads do not change it; a start, drain, removal or outage does."""
    rows = Instance.objects.order_by("pk").values_list("pk", "role", "node_id", "desired_state")
    online = Node.objects.filter(status=NodeStatus.ONLINE).order_by("pk").values_list("pk")
    digest = hashlib.sha256(repr((list(rows), list(online))).encode())
    return digest.hexdigest()


def served_model_of(row: AutopilotSettings) -> ServedModel | None:
    """The served model the autopilot sizes: the settings', else the one with the most
    instances (ties: the first made)."""
    if row.served_model_id is not None:
        return row.served_model
    return (
        ServedModel.objects.annotate(n=Count("instances"))
        .filter(n__gt=0)
        .order_by("-n", "pk")
        .first()
    )


def live_profile(row: AutopilotSettings | None = None) -> dict[str, Any]:
    """The live workload profile of the model the autopilot sizes, over the settings' window."""
    row = row or settings_get()
    model = served_model_of(row)
    return workload_profile(row.window_s, model=model.name if model is not None else None)


def link_of(model: ServedModel | None) -> WANLink | None:
    """The WAN link the model's fleet spans: from a datacenter holding its prefill instances to
    one holding its main decoders (None: no such link; the planner takes the first up)."""
    if model is None:
        return None
    mine = Instance.objects.filter(served_model=model)
    p_dcs = set(mine.filter(role="prefill").values_list("node__datacenter_id", flat=True))
    md_dcs = set(mine.filter(role="main_decode").values_list("node__datacenter_id", flat=True))
    return (
        WANLink.objects.select_related("from_datacenter", "to_datacenter")
        .filter(from_datacenter_id__in=p_dcs, to_datacenter_id__in=md_dcs)
        .order_by("pk")
        .first()
    )


def _inputs(row: AutopilotSettings, scenario: str | None = None) -> dict[str, Any]:
    """The planner's arguments for the sized model's fleet (its WAN link)."""
    return plan_inputs_from_fleet(
        scenario=scenario or row.scenario,
        prefill_counts=[1],
        relay_counts=[0],
        main_counts=[1],
        link=link_of(served_model_of(row)),
    )


def running_by_role(model: ServedModel | None = None) -> dict[str, list[Instance]]:
    """A model's instances meant to run (desired running), per role, newest first."""
    out: dict[str, list[Instance]] = {role: [] for role in ROLES}
    rows = Instance.objects.filter(desired_state=DesiredState.RUNNING)
    if model is not None:
        rows = rows.filter(served_model=model)
    for inst in rows.select_related("node").order_by("-created_at", "-pk"):
        out.setdefault(inst.role, []).append(inst)
    return out


def faults() -> list[str]:
    """What makes the fleet unfit for an automatic change now."""
    out = []
    offline = Node.objects.filter(instances__isnull=False).exclude(status=NodeStatus.ONLINE)
    names = sorted(set(offline.values_list("hostname", flat=True)))
    if names:
        out.append(f"node(s) not online: {', '.join(names[:5])}")
    bad = Instance.objects.filter(actual_state__in=[ActualState.FAILED, ActualState.UNAVAILABLE])
    if bad.exists():
        out.append(f"{bad.count()} instance(s) failed or unavailable")
    if Proposal.objects.filter(status=ProposalStatus.APPLYING).exists():
        out.append("another proposal is being applied")
    return out


# --- making a proposal -----------------------------------------------------------------------


def proposal_create(*, trigger: str = "manual", actor: str = "") -> Proposal:
    """Record a proposal being sized; a worker sizes it after commit (in-process on the
    embedded defaults). Missing fleet data fails here (PlanInputError naming ``fleet``)."""
    row = settings_get()
    _inputs(row)
    model = served_model_of(row)
    proposal = Proposal.objects.create(
        trigger=trigger,
        scenario=row.scenario,
        model=model.name if model is not None else "",
        fingerprint=fleet_fingerprint(),
    )
    event_record(
        kind="autopilot.proposal",
        message=f"Autopilot proposal #{proposal.pk} asked for ({trigger}"
        + (f", by {actor}" if actor else "")
        + ").",
        actor=actor or ACTOR,
    )
    pk = proposal.pk

    def failed(exc: Exception) -> None:
        Proposal.objects.filter(pk=pk, status=ProposalStatus.SIZING).update(
            status=ProposalStatus.FAILED, error=f"could not queue the sizing: {exc}"
        )

    enqueue_after_commit(PROPOSE, pk, on_error=failed)
    return proposal


def _pool_cost(counts: dict[str, int], unit_prices: dict[str, float], places: dict[str, Any]):
    """(cost per hour, per pool rows) of nodes per role at the pools' unit prices."""
    rows, total = {}, 0.0
    for role, n in counts.items():
        pool = places[role]["pool"]
        price = float(unit_prices.get(places[role]["gpu"], 0.0))
        rows[pool] = {"role": role, "nodes": n, "unit_price": price, "cost_per_hour": price * n}
        total += price * n
    return total, rows


def _free_nodes(place: dict[str, Any], taken: set[int]) -> list[Node]:
    """Online nodes of the pool's datacenter and GPU type with no instance, most GPUs first."""
    nodes = (
        Node.objects.filter(
            datacenter_id=place["datacenter"],
            gpu_type_id=place["gpu_type"],
            status=NodeStatus.ONLINE,
            instances__isnull=True,
        )
        .exclude(pk__in=taken)
        .order_by("-gpu_count", "hostname")
    )
    return [n for n in nodes if n.gpu_count >= 1]


def plan_changes(
    current: dict[str, list[Instance]],
    target: dict[str, int],
    places: dict[str, dict[str, Any]],
) -> tuple[list[dict[str, Any]], list[str]]:
    """The steps from the running fleet to `target` nodes per role: starts (on free nodes of
    the pool's place) before drains (newest instance first); and what could not be planned."""
    starts, drains, short = [], [], []
    taken: set[int] = set()
    for role in ROLES:
        have, want = len(current.get(role, [])), int(target.get(role, 0))
        if want > have:
            free = _free_nodes(places[role], taken)
            for node in free[: want - have]:
                taken.add(node.pk)
                starts.append(
                    {
                        "action": "start",
                        "role": role,
                        "node": node.pk,
                        "hostname": node.hostname,
                        "gpus": node.gpu_count,
                        "why": f"{role}: {have} -> {want} nodes",
                    }
                )
            if len(free) < want - have:
                short.append(
                    f"{role}: {want - have} more node(s) wanted, {len(free)} free in its "
                    "datacenter with its GPU type"
                )
        elif want < have:
            for inst in current[role][: have - want]:
                drains.append(
                    {
                        "action": "drain",
                        "role": role,
                        "node": inst.node_id,
                        "hostname": inst.node.hostname,
                        "instance": inst.pk,
                        "why": f"{role}: {have} -> {want} nodes",
                    }
                )
    return starts + drains, short


def _threshold_points(counts: dict[str, int], policy: dict[str, Any]) -> list[dict[str, Any]]:
    """The live thresholds first, then the relay threshold x THRESHOLD_FACTORS under each
    handoff switch of HANDOFF_SWITCHES (each variant once)."""
    base = float(policy.get("wan_time_threshold_s") or 1.0)
    live = {
        "wan_time_threshold_s": base,
        "rld_load_catch_up_below": float(policy.get("rld_load_catch_up_below", 0.5)),
        "rld_load_one_shot_above": float(policy.get("rld_load_one_shot_above", 0.8)),
    }
    variants = [live]
    for factor in THRESHOLD_FACTORS:
        for below, above in HANDOFF_SWITCHES:
            variant = {
                "wan_time_threshold_s": round(base * factor, 4),
                "rld_load_catch_up_below": below,
                "rld_load_one_shot_above": above,
            }
            if variant not in variants:
                variants.append(variant)
    return [{"counts": counts, "policy": v} for v in variants]


# A threshold change is proposed only when it cuts the proposed fleet's P90 by this much.
THRESHOLD_GAIN = 0.02


def best_thresholds(tried: list[dict[str, Any]]) -> dict[str, Any]:
    """The policy of the best row (meets the SLA, lowest P90); the live one (first) unless the
    best beats it by THRESHOLD_GAIN."""
    live = tried[0]
    best = min(tried, key=lambda r: (not r["met"], r["ttft_p90_s"]))
    if live["met"] and best["ttft_p90_s"] >= live["ttft_p90_s"] * (1 - THRESHOLD_GAIN):
        return live["policy"]
    return best["policy"]


def _live_policy() -> dict[str, Any]:
    from routing.services import policy_current, policy_settings

    return policy_settings(policy_current()).to_dict()


# Fewest requests that moved KV over the WAN for the measured throughput to stand in for the
# planner's per-connection rate.
WAN_SAMPLES = 10


def measured_link(fleet: dict[str, Any], profile: dict[str, Any]) -> str:
    """Put the WAN throughput the records measured (per request: its WAN bytes over the
    decoder's wait for them, median) in place of the scenario's per-connection rate of the
    planner's link, capped at the line; a note saying so, or "" without enough samples. The
    scenario's per-connection figure models a window-limited TCP stream over the paper's line;
    the live link may do better or worse, and the records say which."""
    wan = profile.get("wan_gbps") or {}
    measured = wan.get("p50")
    if not measured or int(wan.get("requests") or 0) < WAN_SAMPLES:
        return ""
    for spec in fleet.get("links", {}).values():
        if not isinstance(spec, dict):
            continue
        spec.pop("tcp_window_kb", None)
        spec["per_connection_gbps"] = min(float(measured), float(spec["bandwidth_gbps"]))
    return (
        f"WAN per transfer as measured: {measured:.2f} Gbit/s (median of {wan['requests']} "
        "requests)"
    )


def _sla(row: AutopilotSettings) -> dict[str, float]:
    sla = {}
    if row.p90:
        sla["ttft_p90_s"] = float(row.p90)
    if row.p99:
        sla["ttft_p99_s"] = float(row.p99)
    return sla


def proposal_execute(*, proposal_id: int) -> Proposal | None:
    """Size a proposal (sizing -> proposed / unchanged / failed). Only a proposal in
    ``sizing`` is sized, so a repeated call changes nothing."""
    from planner.size import figures, size

    proposal = Proposal.objects.filter(pk=proposal_id).first()
    if proposal is None or proposal.status != ProposalStatus.SIZING:
        return proposal
    row = settings_get()
    try:
        model = ServedModel.objects.filter(name=proposal.model).first()
        profile = workload_profile(row.window_s, model=proposal.model or None)
        inputs = _inputs(row, proposal.scenario)
        places = inputs["places"]
        keys = {role: places[role]["pool"] for role in ROLES}
        current = running_by_role(model)
        now_counts = {role: len(current.get(role, [])) for role in ROLES}
        floors = floors_of(row)
        fleet = inputs["fleet_spec"]
        fleet["pools"] = [
            {k: p[k] for k in ("role", "gpu", "datacenter")}
            | {"count": max(now_counts[p["role"]], 1 if p["role"] != "relay_decode" else 0)}
            for p in inputs["search_space"]["pools"]
        ]
        unit_prices = {name: float(spec["unit_price"]) for name, spec in fleet["gpu_types"].items()}
        link_note = measured_link(fleet, profile)
        rps = float(profile["sizing_rps"])
        sla = _sla(row)
        overrides = workload_overrides(profile)
        notes = [link_note] if link_note else []
        if rps <= 0:
            target = {role: max(floors[role], 0) for role in ROLES}
            sized: dict[str, Any] = {"note": "no traffic in the window: the floors"}
            predicted: dict[str, Any] = {"rps": 0.0}
            thresholds: dict[str, Any] = {}
            notes.append(f"no request in the last {row.window_s} s: the floors per role")
        else:
            sized = size(
                proposal.scenario,
                rps,
                fleet=fleet,
                sla=sla or None,
                workload=overrides,
                workers=1,
                bcr_scan=(),
                band_pct=0,
                constants_pct=0,
                seeds=0,
                max_count=SIZE_MAX_COUNT,
            )
            best = sized["cheapest"]
            if not best.get("found"):
                raise PlanInputError("rps", best.get("reason") or "no fleet meets the SLA")
            by_pool = best["counts"]
            target = {}
            for role in ROLES:
                found = int(by_pool.get(keys[role], 0))
                target[role] = max(found, floors[role])
                if target[role] > found:
                    notes.append(f"{role}: kept at its floor of {floors[role]} (planner: {found})")
            before_counts = {keys[r]: now_counts[r] for r in ROLES}
            after_counts = {keys[r]: target[r] for r in ROLES}
            # The running fleet can be simulated only when it can serve at all.
            servable = bool(now_counts["prefill"] and now_counts["main_decode"])
            live = _live_policy()
            variants = _threshold_points(after_counts, live)
            points = [{"counts": before_counts}] if servable else []
            points.append({"counts": after_counts})
            common = {"fleet": fleet, "sla": sla or None, "workload": overrides}
            got = figures(proposal.scenario, rps, points, **common)
            before = got[0] if servable else None
            after = got[-1]
            # The thresholds: the proposed fleet's P90 under each (no goodput search).
            tried = figures(proposal.scenario, rps, variants, goodput=False, **common)
            best_policy = best_thresholds(tried)
            predicted = {"rps": rps, "before": before, "after": after}
            thresholds = {
                "live": tried[0]["policy"],
                "best": best_policy,
                "tried": [
                    {**r["policy"], "met": r["met"], "ttft_p90_s": r["ttft_p90_s"]} for r in tried
                ],
            }
        current_cost, current_pools = _pool_cost(now_counts, unit_prices, places)
        target_cost, target_pools = _pool_cost(target, unit_prices, places)
        steps, short = plan_changes(current, target, places)
        notes += short
        reason = _reason(now_counts, target, rps, profile, predicted, current_cost, target_cost)
        status = ProposalStatus.PROPOSED if steps else ProposalStatus.UNCHANGED
        Proposal.objects.filter(pk=proposal_id).update(
            status=status,
            profile=finite_json(profile),
            current={"nodes": now_counts, "pools": current_pools, "cost_per_hour": current_cost},
            target={"nodes": target, "pools": target_pools, "cost_per_hour": target_cost},
            changes=steps,
            predicted=finite_json(predicted),
            thresholds=finite_json(thresholds),
            sizing=finite_json(sized),
            reason=reason + ("" if not notes else " " + "; ".join(notes) + "."),
            updated_at=timezone.now(),
        )
    except Exception as exc:  # includes a worker's soft time limit; the reason is kept
        log.warning("autopilot proposal %s failed", proposal_id, exc_info=True)
        message = exc.message if isinstance(exc, PlanInputError) else f"{exc}"
        Proposal.objects.filter(pk=proposal_id).update(
            status=ProposalStatus.FAILED,
            error=f"{type(exc).__name__}: {message}",
            updated_at=timezone.now(),
        )
    proposal = Proposal.objects.get(pk=proposal_id)
    proposal.guardrails = guardrail_violations(proposal, row)
    proposal.save(update_fields=["guardrails"])
    return proposal


def _money(value: float) -> str:
    return f"{value:,.2f}/h"


def _reason(now, target, rps, profile, predicted, current_cost, target_cost) -> str:
    """The proposal in words."""
    diff = [
        f"{'+' if target[r] > now[r] else ''}{target[r] - now[r]} {r}"
        for r in ROLES
        if target[r] != now[r]
    ]
    rate = profile.get("rate_rps", {})
    head = (
        f"At {rps:.2f} req/s (last minute {rate.get('1m', 0):.2f}, forecast "
        f"{profile.get('forecast_rps', 0):.2f} in {profile.get('forecast_horizon_min')} min)"
    )
    if not diff:
        return f"{head} the running fleet is already the cheapest that meets the SLA."
    after = (predicted or {}).get("after") or {}
    before = (predicted or {}).get("before") or {}
    figures = ""
    if after:
        figures = f"; predicted P90 TTFT {after.get('ttft_p90_s', 0):.2f} s"
        if before:
            figures = (
                f"; predicted P90 TTFT {before.get('ttft_p90_s', 0):.2f} -> "
                f"{after.get('ttft_p90_s', 0):.2f} s"
                + (" (the running fleet misses the SLA)" if not before.get("met") else "")
            )
    return (
        f"{head}: {', '.join(diff)} nodes, cost {_money(current_cost)} -> "
        f"{_money(target_cost)}{figures}."
    )


# --- guardrails and decisions ------------------------------------------------------------------


def guardrail_violations(proposal: Proposal, row: AutopilotSettings | None = None) -> list[str]:
    """Why the automatic mode would not apply this proposal now (empty: it would)."""
    row = row or settings_get()
    out = list(faults())
    last = (
        Proposal.objects.filter(applied_at__isnull=False)
        .exclude(pk=proposal.pk)
        .order_by("-applied_at")
        .first()
    )
    if last is not None and last.applied_at is not None and row.cooldown_s:
        until = last.applied_at + timedelta(seconds=row.cooldown_s)
        if timezone.now() < until:
            out.append(f"cooling down until {until:%H:%M:%S} (proposal #{last.pk} applied)")
    cost = (proposal.target or {}).get("cost_per_hour")
    cap = row.budget_per_hour
    if cap is not None and cost is not None and Decimal(str(cost)) > cap:
        out.append(f"the fleet would cost {cost:,.2f}/h, above the budget {cap}/h")
    out += _scale_down_holds(proposal, row)
    return out


def _scale_down_holds(proposal: Proposal, row: AutopilotSettings) -> list[str]:
    """Why a proposal that shrinks a role waits: a proposal of the last scale_down_after_s
    wanted more of it (a dip in the rate is not a fall), or the fleet misses the SLA now."""
    now_nodes = (proposal.current or {}).get("nodes") or {}
    target = (proposal.target or {}).get("nodes") or {}
    shrinking = [r for r in ROLES if target.get(r, 0) < now_nodes.get(r, 0)]
    if not shrinking:
        return []
    out = []
    since = proposal.created_at - timedelta(seconds=row.scale_down_after_s)
    for earlier in Proposal.objects.filter(
        created_at__gte=since, created_at__lt=proposal.created_at, model=proposal.model
    ).exclude(status__in=[ProposalStatus.SIZING, ProposalStatus.FAILED]):
        wanted = (earlier.target or {}).get("nodes") or {}
        more = [r for r in shrinking if wanted.get(r, 0) > target.get(r, 0)]
        if more:
            out.append(
                f"scale-down held: proposal #{earlier.pk} of the last {row.scale_down_after_s} s "
                f"wanted more {', '.join(more)}"
            )
            break
    sla = (proposal.sizing or {}).get("sla") or _sla(row)
    now = timezone.now()
    live = _ttft_quantiles(now - timedelta(seconds=60), now, proposal.model)
    for key, label in (("ttft_p90_s", "P90"), ("ttft_p99_s", "P99")):
        limit, seen = sla.get(key), live.get(key)
        if limit is not None and seen is not None and seen > limit:
            out.append(f"scale-down held: the fleet misses the SLA now ({label} {seen:.1f} s)")
            break
    return out


def _refuse_stale(proposal: Proposal) -> None:
    """Mark a proposal whose fleet changed since it was made stale, and refuse it."""
    Proposal.objects.filter(pk=proposal.pk, status=ProposalStatus.PROPOSED).update(
        status=ProposalStatus.STALE, updated_at=timezone.now()
    )
    event_record(
        kind="autopilot.stale",
        message=f"Autopilot proposal #{proposal.pk} is stale: the fleet changed since it was made.",
        actor=ACTOR,
    )
    raise ProposalRefused(
        f"proposal #{proposal.pk} is stale: the fleet changed since it was made; ask for a new one",
        stale=True,
    )


def proposal_decide(
    *,
    proposal: Proposal,
    approve: bool,
    actor: str,
    limit: int | None = None,
    enqueue: bool = True,
) -> Proposal:
    """Approve (steps made, apply queued) or reject a proposed proposal. ProposalRefused when
    it is not ``proposed`` or (approving) its fleet changed since it was made. ``limit``: the
    automatic mode's largest change per step (the first ``limit`` changes, starts first).
    ``enqueue=False``: the caller runs the apply itself (the tick), no Celery task is queued."""
    current = Proposal.objects.filter(pk=proposal.pk).first()
    if current is None or current.status != ProposalStatus.PROPOSED:
        state = current.status if current is not None else "gone"
        raise ProposalRefused(f"proposal #{proposal.pk} is {state}, not proposed")
    if approve and current.fingerprint != fleet_fingerprint():
        _refuse_stale(current)
    with transaction.atomic():
        locked = Proposal.objects.select_for_update().get(pk=proposal.pk)
        if locked.status != ProposalStatus.PROPOSED:
            raise ProposalRefused(f"proposal #{locked.pk} is {locked.status}, not proposed")
        locked.decided_by = actor
        locked.decided_at = timezone.now()
        if not approve:
            locked.status = ProposalStatus.REJECTED
            locked.save(update_fields=["status", "decided_by", "decided_at", "updated_at"])
            event_record(
                kind="autopilot.rejected",
                message=f"Autopilot proposal #{locked.pk} rejected by {actor}.",
                actor=actor,
            )
            return locked
        changes = list(locked.changes)
        if limit is not None and len(changes) > limit:
            changes = changes[:limit]
            locked.reason += (
                f" Applied in steps: {limit} of {len(locked.changes)} changes now (largest "
                "change per step); the next proposal takes the rest."
            )
        steps = [
            ProposalStep(
                proposal=locked,
                index=i,
                action=c["action"],
                role=c["role"],
                node_id=c.get("node"),
                instance_id_ref=c.get("instance"),
            )
            for i, c in enumerate(changes)
        ]
        best = (locked.thresholds or {}).get("best") or {}
        live = (locked.thresholds or {}).get("live") or {}
        if best and any(live.get(k) != v for k, v in best.items()):
            steps.append(
                ProposalStep(proposal=locked, index=len(steps), action="policy", role="", note="")
            )
        ProposalStep.objects.bulk_create(steps)
        locked.status = ProposalStatus.APPLYING
        locked.save(update_fields=["status", "decided_by", "decided_at", "reason", "updated_at"])
        event_record(
            kind="autopilot.approved",
            message=f"Autopilot proposal #{locked.pk} approved by {actor}: {len(steps)} step(s).",
            actor=actor,
        )
        if enqueue:
            enqueue_after_commit(APPLY, locked.pk)
    return locked


# --- applying ----------------------------------------------------------------------------------


def _step_event(step: ProposalStep, message: str, instance: Instance | None = None) -> None:
    event_record(
        kind=f"autopilot.{step.action}",
        message=f"Autopilot proposal #{step.proposal_id} step {step.index}: {message}",
        node=step.node if instance is None else None,
        instance=instance,
        data={"proposal": step.proposal_id, "step": step.index, "status": step.status},
        actor=ACTOR,
    )


def _served_model(step: ProposalStep) -> ServedModel | None:
    """The model a start serves: the proposal's."""
    return ServedModel.objects.filter(name=step.proposal.model).first()


def _advance_start(step: ProposalStep) -> None:
    if step.status == ProposalStep.PENDING:
        with transaction.atomic():
            locked = ProposalStep.objects.select_for_update().get(pk=step.pk)
            if locked.status != ProposalStep.PENDING:
                return
            node = Node.objects.filter(pk=locked.node_id).first() if locked.node_id else None
            model = _served_model(locked)
            if node is None or model is None:
                locked.status = ProposalStep.FAILED
                locked.note = "its node or the served model is gone"
                locked.save()
                _step_event(locked, f"start {locked.role} failed: {locked.note}")
                return
            made = instance_create(
                role=locked.role,
                node=node,
                served_model=model,
                gpu_count=node.gpu_count,
                actor=ACTOR,
            )
            locked.instance_id_ref = made.pk
            locked.status = ProposalStep.RUNNING
            locked.note = f"instance {made.pk} starting on {node.hostname}"
            locked.save()
            _step_event(locked, f"start {locked.role} on {node.hostname}", made)
        return
    if step.status == ProposalStep.RUNNING:
        inst = _instance(step.instance_id_ref)
        if inst is None:
            _finish(step, ProposalStep.FAILED, "the started instance was removed")
        elif inst.actual_state == ActualState.RUNNING:
            _finish(step, ProposalStep.DONE, f"instance {inst.pk} running", inst)
        elif inst.actual_state == ActualState.FAILED:
            _finish(step, ProposalStep.FAILED, f"instance {inst.pk} failed to start", inst)
        elif _late(step):
            _finish(step, ProposalStep.FAILED, f"not running after {STEP_TIMEOUT_S:g} s", inst)


def _instance(pk: int | None) -> Instance | None:
    return Instance.objects.filter(pk=pk).first() if pk is not None else None


def _advance_drain(step: ProposalStep) -> None:
    inst = _instance(step.instance_id_ref)
    if inst is None:
        _finish(step, ProposalStep.DONE if step.status == ProposalStep.RUNNING else
                ProposalStep.SKIPPED, "the instance is gone")  # fmt: skip
        return
    if step.status == ProposalStep.PENDING:
        with transaction.atomic():
            locked = ProposalStep.objects.select_for_update().get(pk=step.pk)
            if locked.status != ProposalStep.PENDING:
                return
            if inst.desired_state == DesiredState.RUNNING:
                instance_set_desired_state(
                    instance=inst, desired_state=DesiredState.DRAINED, actor=ACTOR
                )
            locked.status = ProposalStep.RUNNING
            locked.note = f"draining instance {inst.pk} on {inst.node.hostname}"
            locked.save()
            _step_event(locked, f"drain {locked.role} on {inst.node.hostname}", inst)
        return
    if step.status == ProposalStep.RUNNING:
        if inst.actual_state in (ActualState.DRAINED, ActualState.STOPPED):
            hostname = inst.node.hostname
            with transaction.atomic():
                instance_delete(instance=inst, actor=ACTOR)
                _finish(step, ProposalStep.DONE, f"drained and removed from {hostname}")
        elif _late(step):
            _finish(step, ProposalStep.FAILED, f"not drained after {STEP_TIMEOUT_S:g} s", inst)


def _advance_policy(step: ProposalStep) -> None:
    from routing.services import policy_update

    best = (step.proposal.thresholds or {}).get("best") or {}
    with transaction.atomic():
        locked = ProposalStep.objects.select_for_update().get(pk=step.pk)
        if locked.status != ProposalStep.PENDING:
            return
        policy_update(changes=best, actor=ACTOR)
        locked.status = ProposalStep.DONE
        locked.note = ", ".join(f"{k} = {v}" for k, v in best.items())
        locked.save()
        _step_event(locked, f"routing thresholds set: {locked.note}")


def _late(step: ProposalStep) -> bool:
    return (timezone.now() - step.updated_at).total_seconds() > STEP_TIMEOUT_S


def _finish(step: ProposalStep, status: str, note: str, inst: Instance | None = None) -> None:
    updated = ProposalStep.objects.filter(pk=step.pk, status=step.status).update(
        status=status, note=note[:300], updated_at=timezone.now()
    )
    if updated:
        step.status, step.note = status, note
        _step_event(step, f"{step.action} {step.role}: {note}", inst)


# The phases of an apply, in order, and what carries a step of each on.
_ADVANCE = {"start": _advance_start, "drain": _advance_drain, "policy": _advance_policy}


def proposal_apply(*, proposal_id: int) -> Proposal | None:
    """Carry an applying proposal as far as it goes now: starts first (each until running),
    then drains (each until drained, then removed), then the thresholds; applied when every
    step is done, failed when one failed. Safe to call again at any time (the tick does)."""
    proposal = Proposal.objects.filter(pk=proposal_id).first()
    if proposal is None or proposal.status != ProposalStatus.APPLYING:
        return proposal
    steps = list(proposal.steps.select_related("node", "proposal"))
    for phase, advance in _ADVANCE.items():
        todo = [s for s in steps if s.action == phase and s.status in ("pending", "running")]
        for step in todo:
            try:
                advance(step)
            except Exception as exc:  # a refused change fails its step, with why
                log.warning("autopilot step %s failed", step.pk, exc_info=True)
                _finish(step, ProposalStep.FAILED, f"{type(exc).__name__}: {exc}")
        steps = list(proposal.steps.select_related("node", "proposal"))
        if any(s.action == phase and s.status in ("pending", "running") for s in steps):
            return proposal  # the next phase waits for this one
    failed = [s for s in steps if s.status == ProposalStep.FAILED]
    now = timezone.now()
    status = ProposalStatus.FAILED if failed else ProposalStatus.APPLIED
    updated = Proposal.objects.filter(pk=proposal_id, status=ProposalStatus.APPLYING).update(
        status=status,
        applied_at=now,
        error="; ".join(f"step {s.index}: {s.note}" for s in failed)[:2000],
        updated_at=now,
    )
    if updated:
        event_record(
            kind="autopilot.applied" if not failed else "autopilot.failed",
            message=f"Autopilot proposal #{proposal_id} "
            + ("applied." if not failed else f"failed: {len(failed)} step(s) failed."),
            actor=ACTOR,
        )
    return Proposal.objects.get(pk=proposal_id)


# --- the honesty loop and the tick ---------------------------------------------------------------


def _ttft_quantiles(since, until, model: str = "", *, by_arrival: bool = False) -> dict[str, Any]:
    """P90 / P99 TTFT of the served requests that ended in [since, until), or with
    ``by_arrival`` that arrived then (a record's end less its e2e time): what the fleet did
    with the traffic of that span, not with a queue it inherited."""
    from routing.models import RequestRecord

    rows = RequestRecord.objects.filter(created_at__gte=since, status="ok", ttft_s__isnull=False)
    if not by_arrival:
        rows = rows.filter(created_at__lt=until)
    if model:
        rows = rows.filter(model=model)
    values = [
        ttft
        for created, e2e, ttft in rows.values_list("created_at", "e2e_s", "ttft_s")
        if ttft is not None and (not by_arrival or since <= arrived_at(created, e2e) < until)
    ]
    if not values:
        return {"requests": 0}
    q = quantiles(values, (0.9, 0.99))
    return {"requests": len(values), "ttft_p90_s": q["p90"], "ttft_p99_s": q["p99"]}


def record_realised(proposal: Proposal, now=None) -> bool:
    """Append the realised figures of each whole window after apply not yet recorded (at most
    REALISED_WINDOWS); True when one was added."""
    now = now or timezone.now()
    if proposal.applied_at is None or proposal.status != ProposalStatus.APPLIED:
        return False
    done = len(proposal.realised or [])
    if done >= REALISED_WINDOWS:
        return False
    start = proposal.applied_at + timedelta(seconds=done * REALISED_WINDOW_S)
    end = start + timedelta(seconds=REALISED_WINDOW_S)
    if now < end + timedelta(seconds=REALISED_SETTLE_S):
        return False  # the window's last arrivals are still being answered
    after = (proposal.predicted or {}).get("after") or {}
    current = running_by_role(ServedModel.objects.filter(name=proposal.model).first())
    nodes = {role: len(current.get(role, [])) for role in ROLES}
    unit = {p["role"]: p["unit_price"] for p in (proposal.target or {}).get("pools", {}).values()}
    cost = sum(unit.get(r, 0.0) * n for r, n in nodes.items())
    window = {
        "from": start.isoformat(),
        "to": end.isoformat(),
        **_ttft_quantiles(start, end, proposal.model, by_arrival=True),
        "cost_per_hour": cost,
        "nodes": nodes,
        "predicted_ttft_p90_s": after.get("ttft_p90_s"),
        "predicted_cost_per_hour": (proposal.target or {}).get("cost_per_hour"),
    }
    proposal.realised = [*(proposal.realised or []), finite_json(window)]
    proposal.save(update_fields=["realised", "updated_at"])
    return True


def autopilot_tick(now=None) -> dict[str, Any]:
    """One round of the schedule: carry applying proposals on, record realised figures,
    propose when the interval has passed, and in automatic mode approve the newest proposal
    the guardrails allow. Returns what it did."""
    now = now or timezone.now()
    row = settings_get()
    did: dict[str, Any] = {"applied": [], "realised": [], "proposed": None, "approved": None}
    for pk in Proposal.objects.filter(status=ProposalStatus.APPLYING).values_list("pk", flat=True):
        proposal_apply(proposal_id=pk)
        did["applied"].append(pk)
    since = now - timedelta(seconds=REALISED_WINDOW_S * (REALISED_WINDOWS + 1))
    for proposal in Proposal.objects.filter(status=ProposalStatus.APPLIED, applied_at__gte=since):
        if record_realised(proposal, now):
            did["realised"].append(proposal.pk)
    last = Proposal.objects.order_by("-created_at").first()
    if row.interval_s and (
        last is None or (now - last.created_at).total_seconds() >= row.interval_s
    ):
        try:
            did["proposed"] = proposal_create(trigger="schedule").pk
        except PlanInputError as exc:
            log.info("autopilot: no proposal: %s", exc)
    if row.automatic:
        newest = Proposal.objects.order_by("-created_at").first()
        if newest is not None and newest.status == ProposalStatus.PROPOSED:
            why = guardrail_violations(newest, row)
            Proposal.objects.filter(pk=newest.pk).update(guardrails=why)
            if not why:
                try:
                    proposal_decide(
                        proposal=newest,
                        approve=True,
                        actor=ACTOR,
                        limit=row.max_change_per_step,
                        enqueue=False,
                    )
                    did["approved"] = newest.pk
                    # The tick is a worker's task already: it runs the first steps itself
                    # (no second task doing the same), and later ticks carry them on.
                    proposal_apply(proposal_id=newest.pk)
                except ProposalRefused as exc:
                    log.info("autopilot: %s", exc.message)
    return did


def recent(proposals: Iterable[Proposal]) -> list[dict[str, Any]]:
    """Past proposals' predicted and realised P90 TTFT and cost, for the planner page."""
    out = []
    for p in proposals:
        after = (p.predicted or {}).get("after") or {}
        realised = p.realised or []
        out.append(
            {
                "id": p.pk,
                "applied_at": p.applied_at,
                "predicted_p90": after.get("ttft_p90_s"),
                "realised_p90": [w.get("ttft_p90_s") for w in realised],
                "predicted_cost": (p.target or {}).get("cost_per_hour"),
                "realised_cost": [w.get("cost_per_hour") for w in realised],
            }
        )
    return out
