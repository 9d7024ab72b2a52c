"""The autopilot benchmark's summary and report (pure: from the run's collected data)."""

from __future__ import annotations

from typing import Any

from bench.autopilot import run as r

PRICE_PER_NODE = {"paper-a": 2.00 * 8, "paper-b": 2.50 * 8}  # USD per node-hour
GPU_OF_DC = {"auto-a": "paper-a", "auto-b": "paper-b"}


def _within(measured: float | None, reference: float | None, tolerance: float) -> bool | None:
    if measured is None or reference is None or reference == 0:
        return None
    return abs(measured - reference) / abs(reference) <= tolerance


def fleet_cost(instances: list[dict], nodes: dict[int, str]) -> tuple[float, dict[str, int]]:
    """USD per hour of the instances meant to run at the end, and their count per role."""
    roles: dict[str, int] = {}
    cost = 0.0
    for inst in instances:
        if inst.get("desired_state") != "running":
            continue
        roles[inst["role"]] = roles.get(inst["role"], 0) + 1
        host = nodes.get(inst["node"], "")
        dc = host.rsplit("-", 1)[0]
        cost += PRICE_PER_NODE[GPU_OF_DC.get(dc, "paper-a")]
    return cost, roles


def summarise(
    live: dict[str, Any], node_ids: dict[int, str], run_s: float = r.RUN_S
) -> dict[str, Any]:
    results = live["results"]
    minutes = r.per_minute(results, run_s)
    recovered = r.recovered_at(minutes)
    ramp_end = r.RAMP_AT_S + r.RAMP_S
    completed = [x for x in results if x.get("completed")]
    lost = [x for x in results if not x.get("completed")]
    inexact = [x for x in completed if not x.get("exact")]
    ids = {x.get("id") for x in completed}
    recorded = {rec.get("request_id") for rec in live.get("records", [])}
    unrecorded = [i for i in ids if i not in recorded]
    cost, roles = fleet_cost(live.get("instances", []), node_ids)
    offline = live.get("offline", {}).get("cheapest", {})
    offline_cost = None
    if offline.get("found"):
        # The planner's units are nodes at its unit prices (USD per node-hour from the database).
        offline_cost = float(offline["cost_per_hour"])
    applied = [p for p in live.get("proposals", []) if p.get("applied_at")]
    first = min(applied, key=lambda p: p["applied_at"]) if applied else None
    prediction: dict[str, Any] = {}
    if first is not None:
        after = (first.get("predicted") or {}).get("after") or {}
        window = (first.get("realised") or [{}])[0]
        prediction = {
            "proposal": first["id"],
            "predicted_p90_s": after.get("ttft_p90_s"),
            "realised_p90_s": window.get("ttft_p90_s"),
            "predicted_cost_per_hour": (first.get("target") or {}).get("cost_per_hour"),
            "realised_cost_per_hour": window.get("cost_per_hour"),
            "window": {k: window.get(k) for k in ("from", "to", "requests")},
        }
    goals = {
        "sla_recovered_within_5_min": (
            recovered is not None and recovered - ramp_end <= r.RECOVER_WITHIN_S
        ),
        "cost_within_10pct_of_offline": (
            None if offline_cost is None else cost <= offline_cost * (1 + r.COST_WITHIN)
        ),
        "predicted_p90_within_15pct": _within(
            prediction.get("predicted_p90_s"),
            prediction.get("realised_p90_s"),
            r.PREDICTION_WITHIN,
        ),  # fmt: skip
        "predicted_cost_within_15pct": _within(
            prediction.get("predicted_cost_per_hour"),
            prediction.get("realised_cost_per_hour"),
            r.PREDICTION_WITHIN,
        ),  # fmt: skip
        "no_request_lost_or_failed": not lost and not inexact,
    }
    return {
        "requests": len(results),
        "completed": len(completed),
        "lost_or_failed": len(lost),
        "inexact": len(inexact),
        "completed_without_record": len(unrecorded),
        "minutes": minutes,
        "recovered_at_s": recovered,
        "recovered_after_ramp_s": None if recovered is None else recovered - ramp_end,
        "end_fleet": {"roles": roles, "cost_per_hour": cost},
        "offline": {"counts": offline.get("counts"), "cost_per_hour": offline_cost},
        "prediction": prediction,
        "proposals": [
            {
                k: p.get(k)
                for k in (
                    "id",
                    "status",
                    "trigger",
                    "reason",
                    "decided_by",
                    "created_at",
                    "applied_at",
                    "guardrails",
                    "error",
                )
            }
            | {"steps": [(s["action"], s["role"], s["status"]) for s in p.get("steps", [])]}
            for p in sorted(live.get("proposals", []), key=lambda p: p["id"])
        ],  # fmt: skip
        "goals": goals,
    }


def _when(iso: Any) -> str:
    return str(iso or "").replace("T", " ").removesuffix("+00:00")


def _s(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _yes(value: bool | None) -> str:
    return "n/a" if value is None else ("**yes**" if value else "**no**")


def render(summary: dict[str, Any], command: str, meta: dict[str, Any]) -> str:
    s = summary
    lines = [
        "# The autopilot on a live emulated fleet: the rate doubles",
        "",
        "What the automatic mode does when the traffic of a live fleet doubles within a minute.",
        "The scenario (fleet, traffic, settings, goals) is fixed in `bench/autopilot/run.py`'s",
        "docstring, before the first run; docs/autopilot.md explains the autopilot.",
        "",
        "## Command",
        "",
        "```sh",
        command,
        "```",
        "",
        f"Run: {_when(meta.get('started'))} UTC, commit {meta.get('commit')}, "
        f"{meta.get('machine')}; {meta.get('wall_s', 0) / 60:.1f} minutes. Raw output: "
        "`var/bench-autopilot/`.",
        "",
        "## Goals",
        "",
        "| goal | met? | measured |",
        "|---|---|---|",
        f"| SLA (P90 <= 10 s, P99 <= 15 s) met again within 5 min of the ramp | "
        f"{_yes(s['goals']['sla_recovered_within_5_min'])} | every minute from "
        f"{_s(s['recovered_at_s'], 0)} s met it ({_s(s['recovered_after_ramp_s'], 0)} s after "
        f"the ramp's end at {r.RAMP_AT_S + r.RAMP_S:.0f} s) |",
        f"| fleet cost <= 1.10 x the offline `planner size` answer for the new rate | "
        f"{_yes(s['goals']['cost_within_10pct_of_offline'])} | "
        f"{_s(s['end_fleet']['cost_per_hour'])} USD/h ({s['end_fleet']['roles']}) against "
        f"{_s(s['offline']['cost_per_hour'])} USD/h ({s['offline']['counts']}) |",
        f"| predicted P90 TTFT of the applied fleet within 15% of the realised | "
        f"{_yes(s['goals']['predicted_p90_within_15pct'])} | predicted "
        f"{_s(s['prediction'].get('predicted_p90_s'))} s, realised "
        f"{_s(s['prediction'].get('realised_p90_s'))} s |",
        f"| predicted cost per hour within 15% of the realised | "
        f"{_yes(s['goals']['predicted_cost_within_15pct'])} | predicted "
        f"{_s(s['prediction'].get('predicted_cost_per_hour'))}, realised "
        f"{_s(s['prediction'].get('realised_cost_per_hour'))} USD/h |",
        f"| 0 requests lost or failed | {_yes(s['goals']['no_request_lost_or_failed'])} | "
        f"{s['completed']} of {s['requests']} completed, {s['lost_or_failed']} lost or failed, "
        f"{s['inexact']} with other tokens than the engine's, {s['completed_without_record']} "
        "completed without a record |",
        "",
        "## TTFT by the minute the requests arrived (client clock)",
        "",
        "| minute | rate (req/s) | requests | P50 | P90 | P99 | unanswered | SLA met |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for m in s["minutes"]:
        rate = sum(r.rate_at(m["from_s"] + t + 0.5) for t in range(60)) / 60
        lines.append(
            f"| {m['minute']} | {rate:.2f} | {m['requests']} | {_s(m['p50'])} | {_s(m['p90'])} | "
            f"{_s(m['p99'])} | {m['unanswered']} | {'yes' if m['met'] else 'no'} |"
        )
    lines += [
        "",
        "## Proposals",
        "",
        "| # | status | by | reason | steps |",
        "|---|---|---|---|---|",
    ]
    for p in s["proposals"]:
        steps = ", ".join(f"{a} {role} ({st})" for a, role, st in p["steps"]) or "-"
        reason = (p.get("reason") or p.get("error") or "").replace("|", "/")
        lines.append(f"| {p['id']} | {p['status']} | {p.get('decided_by') or '-'} | {reason} | "
                     f"{steps} |")  # fmt: skip
    lines += ["", "## Reading", "", meta.get("reading", "(to be written after the run)"), ""]
    return "\n".join(lines)
