"""Run a scenario's cases over several seeds: TTFT percentiles, RLD token share, and each
case's cut against a reference case (seed by seed, then the mean).

Usage:
    .venv/bin/python bench/planner/seeds.py paper-ttft --reference cdc-pd --seeds 1 2 3 \\
        [--jobs 2] [--rps 78] [--out var/planner/ttft-seeds/78rps.json]
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pdd.vocab import Pipeline
from planner.api import run_case  # noqa: E402
from planner.metrics import TTFT_PARTS  # noqa: E402
from planner.scenario import case_configs, load_scenario  # noqa: E402


def _run(job: tuple[str, str, int, float | None]) -> dict[str, Any]:
    scenario, case, seed, rps = job
    config = copy.deepcopy(case_configs(load_scenario(scenario))[case])
    config.setdefault("workload", {})["seed"] = seed
    if rps is not None:
        config["workload"]["rps"] = rps
    s = run_case(case, config, "fleet").summary
    return {
        "case": case,
        "seed": seed,
        **{q: s["ttft_s"][q] for q in ("p50", "p90", "p99")},
        "relay_share": s["tokens"]["relay_share"],
        "relayed": s["pipelines"].get(Pipeline.P_RLD_MD, 0),
        "requests": s["requests"],
        "pool_wait_mean_s": s["wan_pool_wait_s"]["mean"],
        "md_hit_rate": s["md_hit_rate"],
        "offered_rps": s["offered_rps"],
        "wan_link_utilisation": s["wan_link_utilisation"],
        "wan_pool_utilisation": s["wan_pool_utilisation"],
        "ttft_parts": s["ttft_parts"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("scenario")
    ap.add_argument("--reference", required=True, help="case the others are compared with")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--rps", type=float, default=None,
                    help="drawn rate for every case instead of the scenario's")  # fmt: skip
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.rps is not None and not args.rps > 0:
        print(f"seeds: --rps must be a positive number, got {args.rps}", file=sys.stderr)
        return 2
    try:
        cases = list(case_configs(load_scenario(args.scenario)))
    except ValueError as exc:
        print(f"seeds: {exc}", file=sys.stderr)
        return 2
    if args.reference not in cases:
        print(f"seeds: --reference {args.reference!r} is not a case of {args.scenario}",
              file=sys.stderr)  # fmt: skip
        return 2
    jobs = [(args.scenario, c, s, args.rps) for c, s in itertools.product(cases, args.seeds)]
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        runs = list(pool.map(_run, jobs))
    ref = {r["seed"]: r for r in runs if r["case"] == args.reference}
    rows = []
    print(f"{'case':<18} {'seed':>4} | {'P50':>6} {'P90':>6} {'P99':>6} | {'cut P90':>8} "
          f"{'cut P99':>8} | {'RLD share':>9} {'relayed':>8}")  # fmt: skip
    for case in cases:
        mine = [r for r in runs if r["case"] == case]
        for r in mine:
            r["cut_p90"] = r["p90"] / ref[r["seed"]]["p90"] - 1
            r["cut_p99"] = r["p99"] / ref[r["seed"]]["p99"] - 1
            print(
                f"{case:<18} {r['seed']:>4} | {r['p50']:>6.2f} {r['p90']:>6.2f} {r['p99']:>6.2f} | "
                f"{r['cut_p90']:>+8.1%} {r['cut_p99']:>+8.1%} | {r['relay_share']:>9.1%} "
                f"{r['relayed']:>8d}"
            )
        mean = {k: float(np.mean([r[k] for r in mine])) for k in
                ("p50", "p90", "p99", "cut_p90", "cut_p99", "relay_share")}  # fmt: skip
        print(
            f"{case:<18} {'mean':>4} | {mean['p50']:>6.2f} {mean['p90']:>6.2f} "
            f"{mean['p99']:>6.2f} | {mean['cut_p90']:>+8.1%} {mean['cut_p99']:>+8.1%} | "
            f"{mean['relay_share']:>9.1%}"
        )
        rows.append({"case": case, "mean": mean})
    print("\nwhere the tail's first tokens (TTFT >= P90) spent their time, seed means, s "
          "(metrics.ttft_parts):")  # fmt: skip
    print(f"{'case':<18} | {'prefill':>7} {'kv':>6} {'slot':>6} {'step':>6} | {'relayed':>7}")
    for case in cases:
        tails = [r["ttft_parts"]["tail"] for r in runs if r["case"] == case]
        m = {k: float(np.mean([t[k] for t in tails])) for k in (*TTFT_PARTS, "relayed_share")}
        print(
            f"{case:<18} | {m['prefill']:>7.2f} {m['kv']:>6.2f} {m['slot']:>6.2f} "
            f"{m['step']:>6.3f} | {m['relayed_share']:>7.1%}"
        )
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {
                    "scenario": args.scenario,
                    "reference": args.reference,
                    "rps": args.rps,
                    "runs": runs,
                    "means": rows,
                },
                indent=2,
            )
            + "\n"  # fmt: skip
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
