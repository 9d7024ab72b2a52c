"""Calibrate the offered load and the prefill efficiency of ``paper-ttft`` on baseline TTFTs.

docs/pdd.md publishes the baselines' TTFT on the agentic trace but neither the trace's request rate
nor the engines' achieved prefill efficiency:

* in-datacenter PD median TTFT ~4.2 s versus ~6.7 s with decode in another city;
* CDC-PD (cross-datacenter PD with DRC, no relay) TTFT P90 18.3 s and P99 29.7 s.

The in-datacenter median has no WAN in it, so it measures how loaded the prefill side is; the
cross-city figures add the WAN. This sweeps (rate, prefill efficiency) over a grid, runs on the
``paper-ttft`` fleet both the ``cdc-pd`` case and the same fleet as in-datacenter PD (system
``idc-pd``: decode in datacenter A over RDMA, no WAN), over several seeds, and picks the point
whose seed-mean figures have the smallest worst relative error against those four published
values. Only baselines take part (no relay, no handoff, nothing PDD-specific); every PDD figure
at the chosen point is a prediction. ``--with-pdd`` also runs the ``pdd`` case at every point
and prints its P90 and its cut against CDC-PD beside the baselines (not used in the choice):
how the predicted cut moves with the calibration.

Usage:
    .venv/bin/python bench/planner/calibrate_load.py [--jobs 2] \
        [--rps 110 112 ...] [--eff 0.30 0.32 ...] [--out bench/planner/calibration_load.json]
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.planner.calibrate_decode import check_duration, engine_override  # noqa: E402
from planner.api import run_case  # noqa: E402
from planner.scenario import case_configs, load_scenario  # noqa: E402

# docs/pdd.md, "The published figures": (system, percentile) -> seconds.
TARGET = {
    ("idc-pd", "p50"): 4.2,  # in-DC PD median TTFT
    ("cdc-pd", "p50"): 6.7,  # decode in another city, median TTFT
    ("cdc-pd", "p90"): 18.3,  # CDC-PD TTFT P90
    ("cdc-pd", "p99"): 29.7,  # CDC-PD TTFT P99
}
SYSTEMS = ("idc-pd", "cdc-pd")
PDD = "pdd"  # --with-pdd: reported, never fitted


def _run(
    point: tuple[str, float, float, int, float | None, dict[str, Any], float | None],
) -> dict[str, Any]:
    system, eff, rps, seed, decode_ratio, engine_set, duration_s = point
    # The baselines run on the cdc-pd case's fleet (its system swapped); PDD is its own case.
    case = PDD if system == PDD else "cdc-pd"
    config = copy.deepcopy(case_configs(load_scenario("paper-ttft"))[case])
    config["fleet"]["system"] = system
    config["fleet"]["engine"].update(engine_set)
    config["fleet"]["engine"]["prefill_efficiency"] = eff
    if decode_ratio is not None:
        config["fleet"]["engine"]["decode_mem_efficiency"] = round(decode_ratio * eff, 4)
    config["workload"]["rps"] = rps
    config["workload"]["seed"] = seed
    if duration_s is not None:
        config["workload"]["duration_s"] = duration_s
    start = time.perf_counter()
    s = run_case(system, config, "fleet").summary
    return {
        "system": system,
        "prefill_efficiency": eff,
        "decode_mem_efficiency": config["fleet"]["engine"]["decode_mem_efficiency"],
        "max_decode_batch": config["fleet"]["engine"]["max_decode_batch"],
        "rps": rps,
        "seed": seed,
        "ttft_p50": s["ttft_s"]["p50"],
        "ttft_p90": s["ttft_s"]["p90"],
        "ttft_p99": s["ttft_s"]["p99"],
        "wan_pool_wait_mean_s": s["wan_pool_wait_s"]["mean"] if system == "cdc-pd" else 0.0,
        "ttft_quarter_p50": [q["p50"] for q in s["ttft_quarters"]],
        "drift": drift(s["ttft_quarters"]),
        "wall_s": time.perf_counter() - start,
    }


def drift(quarters: list[dict[str, float]]) -> float:
    """The last quarter's TTFT median over the second's: ~1 in a steady run, above 1 while the
    queues still fill (the first quarter is skipped: it starts from the warm-up's short queues)."""
    if len(quarters) < 4 or not quarters[1]["p50"] > 0:
        return float("nan")
    return float(quarters[3]["p50"] / quarters[1]["p50"])


def _row(runs: list[dict[str, Any]], eff: float, rps: float) -> dict[str, Any]:
    mean: dict[str, float] = {}
    p90_range: dict[str, list[float]] = {}
    drifts: dict[str, float] = {}
    for system in (*SYSTEMS, PDD):
        mine = [r for r in runs if r["system"] == system and r["rps"] == rps
                and r["prefill_efficiency"] == eff]  # fmt: skip
        if not mine:
            continue
        for k in ("p50", "p90", "p99"):
            mean[f"{system}.{k}"] = float(np.mean([r[f"ttft_{k}"] for r in mine]))
        p90s = [r["ttft_p90"] for r in mine]
        if system in SYSTEMS:
            drifts[system] = float(np.mean([r.get("drift", np.nan) for r in mine]))
        p90_range[system] = [min(p90s), max(p90s)]
    err = {f"{s}.{k}": mean[f"{s}.{k}"] / v - 1 for (s, k), v in TARGET.items()}
    row = {
        "prefill_efficiency": eff,
        "rps": rps,
        "mean": mean,
        "p90_range": p90_range,
        "err": err,
        "worst_err": max(abs(e) for e in err.values()),
        "drift": max(drifts.values()) if drifts else float("nan"),
    }
    if f"{PDD}.p90" in mean:
        row["pdd_cut_p90"] = mean[f"{PDD}.p90"] / mean["cdc-pd.p90"] - 1
        row["pdd_cut_p99"] = mean[f"{PDD}.p99"] / mean["cdc-pd.p99"] - 1
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rps", type=float, nargs="+", default=[110, 112, 114, 115, 116, 117, 118])
    ap.add_argument("--eff", type=float, nargs="+", default=[0.30, 0.31, 0.32, 0.33, 0.34, 0.35])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument(
        "--decode-ratio", type=float, default=None,
        help="set decode_mem_efficiency to this multiple of each prefill efficiency (the "
        "balance found by calibrate_decode.py; default: the scenario's decode efficiency)",
    )  # fmt: skip
    ap.add_argument(
        "--engine", type=engine_override, nargs="*", default=[], metavar="KEY=VALUE",
        help="fixed decode settings for every run, e.g. decode_mem_efficiency=0.3 "
        "max_decode_batch=43 (default: the scenario's)",
    )  # fmt: skip
    ap.add_argument(
        "--with-pdd", action="store_true",
        help="also run the pdd case and print its P90 and cut against CDC-PD (not fitted)",
    )  # fmt: skip
    ap.add_argument(
        "--duration", type=float, default=None,
        help="seconds of traffic per run (default: the scenario's); the warm-up stays",
    )  # fmt: skip
    ap.add_argument(
        "--max-drift", type=float, default=None,
        help="choose only among points whose baselines are steady: last-quarter TTFT median "
        "at most this multiple of the second quarter's (default: any point)",
    )  # fmt: skip
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.decode_ratio is not None and not 0 < args.decode_ratio <= 2:
        ap.error("--decode-ratio: must be in (0, 2]")
    engine_set: dict[str, Any] = dict(args.engine)
    if "prefill_efficiency" in engine_set:
        ap.error("--engine: prefill_efficiency is swept by --eff")
    if args.decode_ratio is not None and "decode_mem_efficiency" in engine_set:
        ap.error("--engine: give decode_mem_efficiency or --decode-ratio, not both")
    if not 0 < engine_set.get("decode_mem_efficiency", 1) <= 1:
        ap.error("--engine: decode_mem_efficiency must be in (0, 1]")
    check_duration(ap, args.duration, "paper-ttft", "cdc-pd")
    if args.max_drift is not None and not args.max_drift >= 1:
        ap.error("--max-drift: must be >= 1 (1 = perfectly steady)")
    if any(r <= 0 for r in args.rps):
        ap.error("--rps: rates must be > 0")
    if any(not 0 < e <= 1 for e in args.eff):
        ap.error("--eff: efficiencies must be in (0, 1]")
    grid = [
        (*point, args.decode_ratio, engine_set, args.duration)
        for point in itertools.product(
            (*SYSTEMS, PDD) if args.with_pdd else SYSTEMS, args.eff, args.rps, args.seeds
        )
    ]
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        runs = list(pool.map(_run, grid))
    rows = [_row(runs, eff, rps) for eff in args.eff for rps in args.rps]
    if args.decode_ratio is not None:
        print(f"decode_mem_efficiency = {args.decode_ratio} x prefill efficiency")
    if engine_set:
        print("engine: " + ", ".join(f"{k} {v}" for k, v in engine_set.items()))
    if args.duration is not None:
        print(f"duration: {args.duration:g} s per run")
    print("targets (docs/pdd.md): " + ", ".join(f"{s} {k} {v} s" for (s, k), v in TARGET.items()))
    pdd_head = f" | {'idc P90':>7} {'pdd P90':>7} {'cut P90':>7} {'cut P99':>7}"
    head = f"{'eff':>5} {'rps':>6} | {'idc P50':>7} | {'cdc P50':>7} {'P90':>6} {'P99':>6} | "
    print(head + f"{'cdc P90 range':>13} | worst err | drift" + (pdd_head if args.with_pdd else ""))
    for row in rows:
        m = row["mean"]
        lo, hi = row["p90_range"]["cdc-pd"]
        pdd = (
            f" | {m['idc-pd.p90']:>7.2f} {m['pdd.p90']:>7.2f} {row['pdd_cut_p90']:>7.1%}"
            f" {row['pdd_cut_p99']:>7.1%}"
            if args.with_pdd
            else ""
        )
        print(
            f"{row['prefill_efficiency']:>5.2f} {row['rps']:>6.1f} | {m['idc-pd.p50']:>7.2f} | "
            f"{m['cdc-pd.p50']:>7.2f} {m['cdc-pd.p90']:>6.2f} {m['cdc-pd.p99']:>6.2f} | "
            f"{lo:>6.2f}-{hi:>6.2f} | {row['worst_err']:>9.1%} | {row['drift']:>5.2f}" + pdd
        )
    print("drift: the baselines' last-quarter TTFT median over the second quarter's (1 = steady)")
    eligible = [
        r for r in rows if args.max_drift is None or r["drift"] <= args.max_drift
    ]  # NaN drift (too short a run to tell) is never eligible under --max-drift
    best = min(eligible, key=lambda r: r["worst_err"]) if eligible else None
    if best is None:
        print(f"chosen: none (no point's drift is at most {args.max_drift:g})")
    else:
        print(f"chosen: prefill efficiency {best['prefill_efficiency']}, {best['rps']} RPS "
              f"(worst error {best['worst_err']:.1%}, drift {best['drift']:.2f})")  # fmt: skip
    if args.out:
        target = [{"system": s, "percentile": k, "seconds": v} for (s, k), v in TARGET.items()]
        Path(args.out).write_text(
            json.dumps(
                {
                    "target": target,
                    "decode_ratio": args.decode_ratio,
                    "engine": engine_set,
                    "duration_s": args.duration,
                    "max_drift": args.max_drift,
                    "runs": runs,
                    "rows": rows,
                    "chosen": best,
                },
                indent=2,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
