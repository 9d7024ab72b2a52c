"""Calibrate the WAN connection pool size on PDD's published transfer microbenchmark.

docs/pdd.md (observation 3), one 20 Gbps line at 80 RPS and 90% mean hit: a uniform 85-95% hit
distribution *saturates the connection pool (100% utilisation)* with a *1,682 ms mean wait for a
connection* (and P50 1,210 ms), while the skewed distribution gives P50 248 ms. The pool size
is not published. This sweeps ``link.pool_size`` on the ``paper-microbench`` scenario (transfers
only: no engine, no policy, the same trace for every point) and picks the size whose uniform
mean pool wait is closest to 1,682 ms (in log ratio) among the sizes that keep the published
shape: uniform pool >= 99% busy, skewed P50 within 30% of 248 ms.

Nothing else is looked at: the fleet scenarios (TTFT, BCR, bathtub) are not run here.

Usage:
    .venv/bin/python bench/planner/calibrate_pool.py [--out bench/planner/calibration_pool.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from planner.api import run_case  # noqa: E402
from planner.scenario import case_configs, load_scenario  # noqa: E402

TARGET = {"uniform_mean_wait_s": 1.682, "uniform_p50_s": 1.210, "skewed_p50_s": 0.248}
SKEWED_TOL = 0.30  # the band for the skewed P50
MIN_BUSY = 0.99  # "100% utilisation", to the simulator's resolution


def measure(pool: int) -> dict[str, Any]:
    configs = case_configs(load_scenario("paper-microbench"))
    row: dict[str, Any] = {"pool_size": pool}
    for case in ("skewed", "uniform"):
        config = copy.deepcopy(configs[case])
        config["link"]["pool_size"] = pool
        s = run_case(case, config, "transfer").summary
        row[f"{case}_p50_s"] = s["transfer_s"]["p50"]
        row[f"{case}_p99_s"] = s["transfer_s"]["p99"]
        row[f"{case}_mean_wait_s"] = s["pool_wait_s"]["mean"]
        row[f"{case}_pool_busy"] = s["pool_utilisation"]
        row[f"{case}_unfinished"] = s["unfinished_at_end"]
    row["shape_ok"] = bool(
        row["uniform_pool_busy"] >= MIN_BUSY
        and abs(row["skewed_p50_s"] / TARGET["skewed_p50_s"] - 1) <= SKEWED_TOL
    )
    row["wait_log_err"] = abs(math.log(row["uniform_mean_wait_s"] / TARGET["uniform_mean_wait_s"]))
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pool", type=int, nargs="+", default=[64, 68, 72, 74, 75, 76, 77, 78, 80, 88])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if any(p < 1 for p in args.pool):
        ap.error("--pool: sizes must be >= 1")
    rows = []
    t = TARGET
    print(f"target: uniform mean wait {t['uniform_mean_wait_s']} s at 100% busy, "
          f"uniform P50 {t['uniform_p50_s']} s, skewed P50 {t['skewed_p50_s']} s")  # fmt: skip
    print(f"{'pool':>4} | {'skew P50':>8} {'skew P99':>8} | {'uni P50':>8} {'uni wait':>8} "
          f"{'uni busy':>8} {'unfin':>6} | shape")  # fmt: skip
    for pool in args.pool:
        r = measure(pool)
        rows.append(r)
        print(
            f"{pool:>4} | {r['skewed_p50_s']:>8.3f} {r['skewed_p99_s']:>8.2f} | "
            f"{r['uniform_p50_s']:>8.3f} {r['uniform_mean_wait_s']:>8.3f} "
            f"{r['uniform_pool_busy']:>8.3f} {r['uniform_unfinished']:>6d} | "
            f"{'ok' if r['shape_ok'] else 'no'}",
            flush=True,
        )
    candidates = [r for r in rows if r["shape_ok"]]
    if not candidates:
        print("no pool size keeps the published shape", file=sys.stderr)
        return 1
    best = min(candidates, key=lambda r: r["wait_log_err"])
    print(
        f"chosen: pool_size {best['pool_size']} (uniform mean wait "
        f"{best['uniform_mean_wait_s']:.2f} s vs {TARGET['uniform_mean_wait_s']} s)"
    )
    if args.out:
        Path(args.out).write_text(
            json.dumps({"target": TARGET, "grid": rows, "chosen": best}, indent=2) + "\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
