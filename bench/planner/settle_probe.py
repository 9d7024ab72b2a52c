"""How long closed-loop sessions take to settle: one case at one drawn rate, several settle spans.

For each ``--settle`` value (seconds simulated before the measured span, ``workload.settle_s``)
it runs the case at the drawn ``--rps`` and prints the rate the fleet received over the span
against the drawn one, the TTFT percentiles, the P90 per quarter of the span and the mean
end-to-end time. A fleet that answers slower than the drawn turn gap receives less than drawn
until its session population has built up.

Usage:
    .venv/bin/python bench/planner/settle_probe.py paper-bcr idc-pd-32p --rps 65 \\
        --settle 0 1800 3600 5400 [--duration 900] [--seed 1] [--jobs 2] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from planner.api import run_case  # noqa: E402
from planner.scenario import case_configs, load_scenario  # noqa: E402


def _run(job: tuple[str, str, float, float, float | None, int | None]) -> dict[str, Any]:
    scenario, case, rps, settle, duration, seed = job
    config = copy.deepcopy(case_configs(load_scenario(scenario))[case])
    config.pop("goodput_search", None)  # one run at the drawn rate, not a search
    workload = config.setdefault("workload", {})
    workload.update(rps=rps, settle_s=settle)
    if duration is not None:
        workload["duration_s"] = duration
    if seed is not None:
        workload["seed"] = seed
    s = run_case(case, config, "fleet").summary
    return {
        "settle_s": settle,
        "drawn_rps": s["drawn_rps"],
        "received_rps": s["offered_rps"],
        "received_share": s["offered_rps"] / s["drawn_rps"] if s["drawn_rps"] else None,
        "ttft_s": {q: s["ttft_s"][q] for q in ("p50", "p90", "p99")},
        "ttft_p90_quarters": [q["p90"] for q in s["ttft_quarters"]],
        "e2e_mean_s": s["e2e_s"]["mean"],
        "sla_met": s["sla"]["met"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("scenario")
    ap.add_argument("case")
    ap.add_argument("--rps", type=float, required=True, help="drawn rate")
    ap.add_argument("--settle", type=float, nargs="+", required=True)
    ap.add_argument("--duration", type=float, default=None, help="measured seconds")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.rps <= 0 or any(s < 0 for s in args.settle) or args.jobs < 1:
        ap.error("--rps must be > 0, --settle values >= 0, --jobs >= 1")
    try:
        cases = case_configs(load_scenario(args.scenario))
    except ValueError as exc:
        print(f"settle_probe: {exc}", file=sys.stderr)
        return 2
    if args.case not in cases:
        print(f"settle_probe: {args.case!r} is not a case of {args.scenario}", file=sys.stderr)
        return 2
    jobs = [(args.scenario, args.case, args.rps, s, args.duration, args.seed) for s in args.settle]
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        rows = list(pool.map(_run, jobs))
    print(f"{args.scenario} {args.case} at {args.rps:g} RPS drawn")
    print(f"{'settle s':>8} | {'drawn':>6} {'recvd':>6} {'share':>6} | {'P50':>6} {'P90':>6} "
          f"{'P99':>6} | {'P90 by quarter':<27} | {'e2e':>5} SLA")  # fmt: skip
    for r in rows:
        t, q = r["ttft_s"], " ".join(f"{x:6.2f}" for x in r["ttft_p90_quarters"])
        print(
            f"{r['settle_s']:>8.0f} | {r['drawn_rps']:>6.1f} {r['received_rps']:>6.1f} "
            f"{r['received_share']:>6.1%} | {t['p50']:>6.2f} {t['p90']:>6.2f} {t['p99']:>6.2f} | "
            f"{q:<27} | {r['e2e_mean_s']:>5.0f} {'met' if r['sla_met'] else 'missed'}"
        )
    if args.out:
        out = {"scenario": args.scenario, "case": args.case, "rps": args.rps, "rows": rows}
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
