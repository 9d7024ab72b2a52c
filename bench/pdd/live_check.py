"""The simulator against the live testbed: `make bench`'s committed run, predicted again.

For every (system, rate) of the live run (bench/pdd/summary.json) this regenerates the
simulator's prediction on the same scaled scenario (bench/pdd/sim.py: the same trace, i.e. the
same workload, seed and rate, the testbed's link, prices and policies, the engine step times
the run measured), without any agent, and prints it beside the live figures: P90 TTFT (% off
the live value; issue 26's goal: within 15%) and the RLD token share (points off; goal: within
2 points).

Arms, fixed before they were first run against the live figures:

* ``dedicated``: every engine alone at its measured speed (what the committed run's own
  ``sim`` figures are; this arm must reproduce them);
* ``host``: the engines share one host of the run's cores (``fleet.host``, planner/host.py:
  each busy engine's work stretched by max(1, busy engines / cores));
* ``host+gateway``: as ``host``, plus the gateway's CPU per request on that host
  (bench/pdd/sim.py ``GATEWAY_CPU_S``, 18.3 ms from bench/gateway/REPORT.md): the prediction;
* ``measured-cpu`` (diagnostic, not a prediction): as ``host``, with the CPU the run itself
  measured for its gateway and load client (REPORT.md's CPU table, cores / offered rate) as the
  per-request work: how much of the gap the non-engine processes on the machine explain.
* ``host+gateway+fabric`` (added on 2026-12-03, after the arms above showed the KV wait short):
  as ``host+gateway``, with the intra-datacenter KV fabric measured on the agents (latency and
  bandwidth of a handoff, bench/pdd/calibrate.py ``measure_fabric``) instead of the assumed
  0.5 ms and 8 Gbit/s: the run's own measurement when its summary has one (then every arm uses
  it), else ``calibration_fabric.json`` (measured on idle agents on this machine);
* ``host+gateway+handoffs`` (added with it, the rule ``make bench`` now runs): as
  ``host+gateway+fabric``, with the measured handoff's fixed part (the ends' export and import
  work) charged to every KV transfer over the WAN too (the link's ``handoff_ms``).
* ``host+gateway+reports`` (added on 2026-12-03, after the arms above relayed more requests
  than the live gateway; the rule ``make bench`` now runs): as ``host+gateway+handoffs``, with
  the WAN link's use seen by the policy as the live gateway sees it, from the P agent's
  heartbeat (every ``bench.pdd.fleet.HEARTBEAT_S`` = 2 s: the bytes the link carried over the
  last interval; the link's ``report_interval_s``) instead of at the moment of each decision.
* ``host+gateway+in-flight`` (added with it, for the same reason; the rule ``make bench``
  now runs): as ``host+gateway+reports``, with the decision counting the KV already on its way
  to MD as MD's prefix (``fleet.decision_counts_in_flight``), as the live gateway counts an
  MD agent's ``incoming_prefix_blocks`` (routing/live.py); the simulator's default is off.
* ``all-cpu`` (added on 2026-12-03, late; a diagnostic, not a prediction): as
  ``host+gateway+in-flight``, with every process's CPU that the simulator does not charge as
  contention on the host: the gateway task's work per request is 18.3 ms plus (the cores the
  run measured for all its processes - the cores ``host+gateway+in-flight`` simulates for its
  engines and gateway) / rate. Whether the CPU the agents, gateway and client spend outside the
  modelled engine work explains the gap as contention for the cores.
* ``measured-engines`` (added on 2026-12-03, late, with the agents' ``engine.busy_s``; a
  diagnostic, for runs that measured it): as ``host+gateway+in-flight``, with the engines' speed
  taken from the run: the prefill fit (overhead, per token, per token pair) multiplied by the
  live P engines' busy time over the busy time ``host+gateway+in-flight`` simulates for them,
  the decode fit (overhead, per context token) by the same ratio for RLD and MD together.
  Whether the engines' slower work under the run's load explains the gap.
* ``prior-engines`` (added with it; a prediction, with ``--factors-from OTHER``): as
  ``measured-engines``, with the factors of the same system and rate measured in *another* run
  (its live engines' busy time over its own simulated engines' busy time, both in its
  summary), applied to this run's own engine fit: engine speed under load measured once,
  before the run it predicts.

The earlier arms simulate these two as the committed run's own simulation did
(``meta.sim_link_reports_s`` and ``meta.sim_decision_in_flight`` of its summary; runs before
the last of 2026-12-03 used neither), so that ``dedicated`` still reproduces the committed
figures.

The committed summary.json does not carry the engine fit, nor the per-process CPU and the
records' P / KV-wait means (later runs' summaries do); they are then read from REPORT.md,
where the engine fit is printed rounded (so the ``dedicated`` arm reproduces the committed
``sim`` figures to within that rounding, not bit for bit).

``--runs S1 S2 ...`` reads several runs' summaries instead (each run's own ``sim``, the
prediction ``make bench`` makes) and gives, per system and rate, the live P90 of every run, its
run-to-run spread, each run's simulated P90 and error, and the median simulated P90 against the
median live one: whether the goal holds beyond one run's noise.

Usage (from the repository root):
    .venv/bin/python -m bench.pdd.live_check [--systems pdd] [--rates u50] \
        [--out var/planner/live_check.json] [--publish bench/planner/live_check.json]
    .venv/bin/python -m bench.pdd.live_check --runs A/summary.json B/summary.json ...
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import re
import statistics
from pathlib import Path
from typing import Any

from bench.pdd import report as pdd_report
from bench.pdd import sim as pdd_sim
from pdd.vocab import Pipeline

ROOT = Path(__file__).resolve().parents[2]
ARMS = (
    "dedicated",
    "host",
    "host+gateway",
    "measured-cpu",
    "host+gateway+fabric",
    "host+gateway+handoffs",
    "host+gateway+reports",
    "host+gateway+in-flight",
    "all-cpu",
    "measured-engines",
    "prior-engines",
)
# ``all-cpu`` charges the CPU this arm's simulation leaves out, ``measured-engines`` scales the
# engines by the live busy time over this arm's; both run with this arm's rules.
ALL_CPU_BASE = "host+gateway+in-flight"
NEEDS_BASE = ("all-cpu", "measured-engines", "prior-engines")
DECODE_ROLES = ("relay_decode", "main_decode")
# The arms with the measured fabric: is its fixed part charged to WAN transfers too?
MEASURED_FABRIC = {
    "host+gateway+fabric": False,
    "host+gateway+handoffs": True,
    "host+gateway+reports": True,
    "host+gateway+in-flight": True,
    "all-cpu": True,
    "measured-engines": True,
    "prior-engines": True,
}
# Arms whose policy sees the link's reported use; of those, arms counting in-flight KV.
REPORTED_USE = {"host+gateway+reports", "host+gateway+in-flight", *NEEDS_BASE}
IN_FLIGHT = {"host+gateway+in-flight", *NEEDS_BASE}
# The KV fabric measured on idle agents (bench/pdd/calibrate.py measure_fabric / fit_fabric),
# for a run whose summary has none (runs before 2026-12-03 measured no fabric).
FABRIC_FILE = ROOT / "bench/planner/calibration_fabric.json"
PREDICTION = "host+gateway"  # the arm the headline states
P90_GOAL = 0.15
SHARE_GOAL_POINTS = 2.0

ENGINE_LINE = re.compile(
    r"prefill (?P<po>[\d.]+) ms \+ (?P<pt>[\d.]+) us/token \+ (?P<pp>[\d.]+) ns per "
    r"token-pair.*?decode step (?P<do>[\d.]+) ms \+ (?P<dc>[\d.]+) us per context token"
)


def engine_from_report(text: str) -> dict[str, Any]:
    """The engine fit as REPORT.md prints it (rounded to the digits shown)."""
    m = ENGINE_LINE.search(text)
    if m is None:
        raise ValueError("REPORT.md: no 'Engines measured' line with the fitted step times")
    return {
        "prefill": {
            "overhead_s": float(m["po"]) * 1e-3,
            "per_token_s": float(m["pt"]) * 1e-6,
            "per_pair_s": float(m["pp"]) * 1e-9,
        },
        "decode": {"overhead_s": float(m["do"]) * 1e-3, "per_ctx_token_s": float(m["dc"]) * 1e-6},
        "_source": "REPORT.md's Engines line (rounded)",
    }


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _num(cell: str) -> float | None:
    cell = cell.strip("* ")
    try:
        return float(cell)
    except ValueError:
        return None


def live_extras_from_report(text: str, results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per system and rate key, from REPORT.md's tables: the records' P and KV-wait means and
    each process's CPU (cores) with the load average. Keyed like summary.json's ``live``."""
    labels = {
        (pdd_report.LABELS[s], pdd_report.rate_label(results, k)): (s, k)
        for s in pdd_report.SYSTEM_ORDER
        for k in pdd_report.rate_keys(results)
    }
    roles = ("prefill", "relay_decode", "main_decode", "gateway", "client")
    out: dict[str, dict[str, Any]] = {}
    for line in text.splitlines():
        if not line.startswith("| "):
            continue
        cells = _cells(line)
        key = labels.get((cells[0], cells[1])) if len(cells) > 2 else None
        if key is None:
            continue
        row = out.setdefault(key[0], {}).setdefault(key[1], {})
        if len(cells) == 11:  # requests and records
            prefill, kv_wait, _ = (_num(x) for x in cells[8].split("/"))
            row["record_means"] = {"prefill_s": prefill, "kv_wait_s": kv_wait}
        elif len(cells) == 8:  # CPU per process and the load average
            cpu = {r: _num(c) for r, c in zip(roles, cells[2:7], strict=True)}
            row["cpu"] = {r: v for r, v in cpu.items() if v is not None}
            row["cpu"]["load_avg"] = _num(cells[7])
    return out


def cores_of(meta: dict[str, Any]) -> int:
    """The testbed machine's cores, from the run's ``machine`` line ("2 cores, x86_64, ...")."""
    m = re.match(r"\s*(\d+) cores", str(meta.get("machine", "")))
    if m is None:
        raise ValueError(f"meta.machine: no core count in {meta.get('machine')!r}")
    return int(m.group(1))


@functools.cache
def committed_fabric() -> dict[str, Any]:
    """The KV fabric measured on idle agents (``FABRIC_FILE``): latency_ms and gbps."""
    data = json.loads(FABRIC_FILE.read_text())
    return {"latency_ms": float(data["latency_ms"]), "gbps": float(data["gbps"])}


def host_for(
    arm: str, cores: int, rps: float, live: dict[str, Any], base_cpu: dict[str, float] | None = None
) -> dict[str, Any] | None:
    """The simulated host of ``arm``; ``base_cpu``: the cores per role that ``ALL_CPU_BASE``
    simulated for the row (``all-cpu`` only)."""
    if arm == "dedicated":
        return None
    if arm == "host":
        return {"cores": cores}
    cpu = live.get("cpu") or {}
    if arm == "all-cpu":
        measured = sum(v or 0.0 for r, v in cpu.items() if r != "load_avg")
        simulated = sum((base_cpu or {}).values())
        extra = max(0.0, measured - simulated) / rps
        return {"cores": cores, "request_cpu_s": pdd_sim.GATEWAY_CPU_S + extra}
    if arm in ("host+gateway", *MEASURED_FABRIC):
        return {"cores": cores, "request_cpu_s": pdd_sim.GATEWAY_CPU_S}
    outside = sum(cpu.get(r) or 0.0 for r in ("gateway", "client"))
    return {"cores": cores, "request_cpu_s": outside / rps}


def committed_sim(summary: dict[str, Any], system: str, key: str) -> dict[str, Any]:
    """The run's own simulated TTFT per arm: ``sim`` was every engine alone until runs also
    wrote ``sim_dedicated`` (then ``sim`` is the testbed host's, the ``host+gateway`` arm)."""

    def ttft(name: str) -> Any:
        return (summary.get(name, {}).get(system, {}).get(key) or {}).get("ttft_s")

    if summary.get("sim_dedicated"):
        found = {"dedicated": ttft("sim_dedicated"), "host+gateway": ttft("sim")}
    else:
        found = {"dedicated": ttft("sim")}
    return {arm: t for arm, t in found.items() if t}


def p90_error(sim: float, live: float) -> float:
    return (sim - live) / live if live else math.nan


def engine_factors(
    busy: dict[str, float] | None, simulated: dict[str, float] | None
) -> tuple[float, float] | None:
    """(prefill, decode): the live engines' busy time over the simulated engines' (cores per
    role), decode for RLD and MD together; None when the run did not measure it."""
    if not busy or not simulated or not busy.get("prefill") or not simulated.get("prefill"):
        return None
    live_decode = sum(busy.get(r) or 0.0 for r in DECODE_ROLES)
    sim_decode = sum(simulated.get(r) or 0.0 for r in DECODE_ROLES)
    decode = live_decode / sim_decode if live_decode > 0 and sim_decode > 0 else 1.0
    return busy["prefill"] / simulated["prefill"], decode


def prior_factors(
    other: dict[str, Any] | None, system: str, key: str
) -> tuple[float, float] | None:
    """The engine factors ``other`` measured for (system, rate): its live engines' busy time
    over its own simulated engines' (``sim`` on the testbed host, the ``host+gateway`` arm with
    that run's rules)."""
    if other is None:
        return None
    live = (other.get("live", {}).get(system) or {}).get(key) or {}
    sim = (other.get("sim", {}).get(system) or {}).get(key) or {}
    return engine_factors(live.get("engine_busy"), (sim.get("host") or {}).get("cpu"))


def scaled_engine(engine: dict[str, Any], prefill: float, decode: float) -> dict[str, Any]:
    """The engine fit with every prefill term times ``prefill`` and every decode term times
    ``decode``."""
    pre = {k: v * prefill if k in ("overhead_s", "per_token_s", "per_pair_s") else v
           for k, v in engine["prefill"].items()}  # fmt: skip
    dec = {k: v * decode if k in ("overhead_s", "per_ctx_token_s") else v
           for k, v in engine["decode"].items()}  # fmt: skip
    return {**engine, "prefill": pre, "decode": dec}


def check(
    summary: dict[str, Any],
    report_text: str,
    systems: list[str] | None = None,
    rates: list[str] | None = None,
    arms: tuple[str, ...] = ARMS,
    factors_from: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Every arm on every (system, rate) of ``summary``; ``factors_from``: another run's
    summary, whose measured engine factors the ``prior-engines`` arm applies (else no such
    arm)."""
    engine = summary.get("engine") or engine_from_report(report_text)
    extras = live_extras_from_report(report_text, summary) if report_text else {}
    cores = cores_of(summary["meta"])
    sla = summary["scaling"]["sla"]
    duration = float(summary["meta"]["duration_s"])
    rps_of = {r["key"]: r["rps"] for r in summary["scaling"]["rates"]}
    run_reports_s = float(summary["meta"].get("sim_link_reports_s", 0.0))
    run_in_flight = bool(summary["meta"].get("sim_decision_in_flight", False))
    if any(a in arms for a in NEEDS_BASE):  # their base arm is simulated before them
        arms = tuple(a for a in ARMS if a in arms or a == ALL_CPU_BASE)
    rows = []
    for system in pdd_report.systems(summary):
        if systems and system not in systems:
            continue
        for key in pdd_report.rate_keys(summary):
            if (rates and key not in rates) or key not in summary["live"][system]:
                continue
            live = {**summary["live"][system][key], **extras.get(system, {}).get(key, {})}
            row: dict[str, Any] = {
                "system": system,
                "rate": key,
                "rps": rps_of[key],
                "live": {
                    "ttft_s": live["ttft_s"],
                    "rld_share": live["rld_share"],
                    "record_means": live.get("record_means"),
                    "cpu": live.get("cpu"),
                    "engine_busy": live.get("engine_busy"),
                },
                "committed_sim": committed_sim(summary, system, key),
                "sim": {},
            }
            for arm in arms:
                base = row["sim"].get(ALL_CPU_BASE, {}).get("cpu")
                host = host_for(arm, cores, rps_of[key], live, base)
                arm_engine = engine
                factors = None
                if arm == "measured-engines":
                    factors = engine_factors(live.get("engine_busy"), base)
                elif arm == "prior-engines":
                    factors = prior_factors(factors_from, system, key)
                if arm in ("measured-engines", "prior-engines"):
                    if factors is None:
                        continue  # no engines' busy time measured (in that run)
                    arm_engine = scaled_engine(engine, *factors)
                if arm in MEASURED_FABRIC and not arm_engine.get("fabric"):
                    fabric = {**committed_fabric(), "wan_handoff": MEASURED_FABRIC[arm]}
                    arm_engine = {**arm_engine, "fabric": fabric}
                reports_s = pdd_sim.HEARTBEAT_S if arm in REPORTED_USE else run_reports_s
                in_flight = arm in IN_FLIGHT or run_in_flight
                m = pdd_sim.simulate(
                    system, arm_engine, rps_of[key], duration, sla, host, reports_s, in_flight
                )
                row["sim"][arm] = {
                    "host": host,
                    "ttft_s": m["ttft_s"],
                    "rld_share": m["rld_share"],
                    "p90_error": p90_error(m["ttft_s"]["p90"], live["ttft_s"]["p90"]),
                    "share_points": 100 * (m["rld_share"] - live["rld_share"]),
                    "means": m["means"],
                    "cpu": (m.get("host") or {}).get("cpu"),
                    "relayed": m["pipelines"].get(Pipeline.P_RLD_MD, 0),
                    "requests": m["requests"],
                }
                if factors is not None:
                    prefill, decode = factors
                    row["sim"][arm]["engine_factors"] = {"prefill": prefill, "decode": decode}
            rows.append(row)
    return {
        "source": "bench/pdd/summary.json and bench/pdd/REPORT.md (make bench, "
        f"{summary['meta'].get('started', '')}, git {summary['meta'].get('git', '')})",
        "engine": engine,
        "cores": cores,
        "gateway_cpu_s": pdd_sim.GATEWAY_CPU_S,
        "goals": {"p90_error": P90_GOAL, "share_points": SHARE_GOAL_POINTS},
        "rows": rows,
        "verdict": verdict(rows),
    }


def verdict(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per arm: the worst |P90 error| and |share points| over the rows, and whether both goals
    hold on every row."""
    out: dict[str, Any] = {}
    for arm in {a for r in rows for a in r["sim"]}:
        errs = [abs(r["sim"][arm]["p90_error"]) for r in rows if arm in r["sim"]]
        shares = [abs(r["sim"][arm]["share_points"]) for r in rows if arm in r["sim"]]
        within = sum(1 for e in errs if e <= P90_GOAL)
        out[arm] = {
            "worst_p90_error": max(errs),
            "best_p90_error": min(errs),
            "p90_within_goal": f"{within} of {len(errs)}",
            "worst_share_points": max(shares),
            "met": all(e <= P90_GOAL for e in errs) and all(s <= SHARE_GOAL_POINTS for s in shares),
        }
    return dict(sorted(out.items()))


def render(result: dict[str, Any]) -> str:
    arms = [a for a in ARMS if any(a in r["sim"] for r in result["rows"])]
    lines = [
        "system  rate | live P90 | "
        + " | ".join(f"{a} P90 (err)" for a in arms)
        + " | live RLD | "
        + " | ".join(f"{a} RLD (pts)" for a in arms)
    ]
    for r in result["rows"]:
        lp = r["live"]["ttft_s"]["p90"]
        p90s = " | ".join(
            f"{r['sim'][a]['ttft_s']['p90']:.3f} ({100 * r['sim'][a]['p90_error']:+.1f}%)"
            if a in r["sim"]
            else "-"
            for a in arms
        )
        shares = " | ".join(
            f"{100 * r['sim'][a]['rld_share']:.1f}% ({r['sim'][a]['share_points']:+.1f})"
            if a in r["sim"]
            else "-"
            for a in arms
        )
        lines.append(
            f"{r['system']:7} {r['rate']:4} | {lp:.3f} | {p90s} | "
            f"{100 * r['live']['rld_share']:.1f}% | {shares}"
        )
    for arm, v in result["verdict"].items():
        lines.append(
            f"{arm}: |P90 error| {100 * v['best_p90_error']:.1f}-{100 * v['worst_p90_error']:.1f}%"
            f" ({v['p90_within_goal']} within 15%), worst RLD share "
            f"{v['worst_share_points']:.1f} points: {'met' if v['met'] else 'not met'}"
        )
    for arm in arms:
        reproduced = [
            abs(r["sim"][arm]["ttft_s"]["p90"] / r["committed_sim"][arm]["p90"] - 1)
            for r in result["rows"]
            if arm in r["committed_sim"]
        ]
        if reproduced:
            lines.append(
                f"{arm} vs the committed sim P90: within {100 * max(reproduced):.2f}% "
                f"(engine: {result['engine'].get('_source', 'summary.json')})"
            )
    return "\n".join(lines)


def runs_table(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """Several ``make bench`` runs side by side: per (system, rate), each run's live and
    simulated P90 TTFT and RLD share (the run's own ``sim``), the live spread (largest over
    smallest - 1) and the median simulated P90's error against the median live P90."""
    rows = []
    first = summaries[0]
    for system in pdd_report.systems(first):
        for key in pdd_report.rate_keys(first):
            runs = [
                (s["live"][system][key], s["sim"][system][key])
                for s in summaries
                if key in s.get("live", {}).get(system, {})
                and key in s.get("sim", {}).get(system, {})
            ]
            if not runs:
                continue
            live = [lv["ttft_s"]["p90"] for lv, _ in runs]
            sim = [sm["ttft_s"]["p90"] for _, sm in runs]
            errors = [p90_error(b, a) for a, b in zip(live, sim, strict=True)]
            live_med, sim_med = statistics.median(live), statistics.median(sim)
            rows.append(
                {
                    "system": system,
                    "rate": key,
                    "live_p90_s": live,
                    "sim_p90_s": sim,
                    "p90_errors": errors,
                    "runs_within_goal": sum(1 for e in errors if abs(e) <= P90_GOAL),
                    "live_spread": max(live) / min(live) - 1 if min(live) > 0 else math.inf,
                    "live_median_p90_s": live_med,
                    "sim_median_p90_s": sim_med,
                    "median_error": p90_error(sim_med, live_med),
                    "live_rld_share": [lv["rld_share"] for lv, _ in runs],
                    "sim_rld_share": [sm["rld_share"] for _, sm in runs],
                }
            )
    medians_within = sum(1 for r in rows if abs(r["median_error"]) <= P90_GOAL)
    return {
        "runs": [{k: s["meta"].get(k) for k in ("started", "git", "machine")} for s in summaries],
        "goals": {"p90_error": P90_GOAL, "share_points": SHARE_GOAL_POINTS},
        "rows": rows,
        "medians_within_goal": f"{medians_within} of {len(rows)}",
    }


def render_runs(result: dict[str, Any]) -> str:
    lines = [
        "runs: " + "; ".join(f"{r['started']} ({r['git']})" for r in result["runs"]),
        "system  rate | live P90 per run (s) | spread | sim P90 per run (error) | "
        "median live -> median sim (error) | live / sim RLD share per run",
    ]
    for r in result["rows"]:
        live = " / ".join(f"{x:.3f}" for x in r["live_p90_s"])
        pairs = zip(r["sim_p90_s"], r["p90_errors"], strict=True)
        sim = " / ".join(f"{x:.3f} ({100 * e:+.0f}%)" for x, e in pairs)
        shares = zip(r["live_rld_share"], r["sim_rld_share"], strict=True)
        share = " / ".join(f"{100 * a:.1f}-{100 * b:.1f}" for a, b in shares)
        lines.append(
            f"{r['system']:7} {r['rate']:4} | {live} | {100 * r['live_spread']:.0f}% | {sim} | "
            f"{r['live_median_p90_s']:.3f} -> {r['sim_median_p90_s']:.3f} "
            f"({100 * r['median_error']:+.1f}%) | {share}"
        )
    lines.append(f"median simulated P90 within 15% of the median live P90: "
                 f"{result['medians_within_goal']} rows")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--summary", default=str(ROOT / "bench/pdd/summary.json"))
    ap.add_argument("--report", default=str(ROOT / "bench/pdd/REPORT.md"))
    ap.add_argument("--systems", nargs="*", default=None)
    ap.add_argument("--rates", nargs="*", default=None, help="rate keys, e.g. u50 u90")
    ap.add_argument("--arms", nargs="*", default=list(ARMS), choices=ARMS)
    ap.add_argument("--out", default=str(ROOT / "var/planner/live_check.json"))
    ap.add_argument("--publish", default=None, help="also write the result here (small JSON)")
    ap.add_argument(
        "--factors-from", default=None, metavar="SUMMARY",
        help="another run's summary.json: the prior-engines arm takes its engine factors",
    )  # fmt: skip
    ap.add_argument(
        "--runs", nargs="+", default=None, metavar="SUMMARY",
        help="several runs' summary.json: their live and simulated figures side by side",
    )  # fmt: skip
    args = ap.parse_args(argv)
    if args.runs:
        try:
            summaries = [json.loads(Path(p).read_text()) for p in args.runs]
        except (OSError, ValueError) as exc:
            ap.error(f"--runs: {exc}")
        runs = runs_table(summaries)
        print(render_runs(runs))
        for path in filter(None, (args.out, args.publish)):
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(json.dumps(rounded(runs), indent=1) + "\n")
        return 0
    summary = json.loads(Path(args.summary).read_text())
    report_path = Path(args.report)
    text = report_path.read_text() if report_path.exists() else ""
    factors_from = None
    if args.factors_from:
        try:
            factors_from = json.loads(Path(args.factors_from).read_text())
        except (OSError, ValueError) as exc:
            ap.error(f"--factors-from: {exc}")
    result = check(summary, text, args.systems, args.rates, tuple(args.arms), factors_from)
    if factors_from is not None:
        result["factors_from"] = factors_from.get("meta", {}).get("started")
    print(render(result))
    for path in filter(None, (args.out, args.publish)):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(rounded(result), indent=1) + "\n")
    return 0


def rounded(x: Any, digits: int = 6) -> Any:
    """The same structure with floats to ``digits`` significant digits (a small JSON)."""
    if isinstance(x, float):
        return float(f"{x:.{digits}g}") if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: rounded(v, digits) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [rounded(v, digits) for v in x]
    return x


if __name__ == "__main__":
    raise SystemExit(main())
