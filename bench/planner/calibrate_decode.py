"""Calibrate decode's absolute speed on the balance of the published PDD fleet.

docs/pdd.md publishes how much faster the decode-friendly chip decodes (GPU-B 210% of GPU-A) but not
how fast either decodes; in the model that absolute speed is ``engine.decode_mem_efficiency``
(the share of peak memory bandwidth a decode step achieves, all per-step time included). It
does publish the fleet PDD ran on: 40 P (GPU-A) feeding 32 MD (GPU-B). A deployment is sized
for its load, so this takes that fleet as balanced: its 32 MD carry, under the SLA, what its
40 P carry.

For each decode efficiency on a grid it runs the ``paper-bcr`` PDD case twice, with a goodput
search each (the highest rate meeting P90 TTFT < 10 s and P99 < 15 s):

* prefill side: the MD pool and the WAN line made ample (x``--ample``), so only P binds;
* decode side: the P pool and the WAN line made ample, so only MD binds.

Both sides run with the policy's full-MD rule off (``relay_when_main_saturated``): the balance
is between the P pool and MD's own slots, not MD with RLD taking its queue.

The balanced efficiency is where the two goodputs meet (linear interpolation between grid
points of their difference). Only the PDD fleet's composition and the SLA take part: no IDC-PD
run, no BCR, no TTFT figure; every BCR at the chosen value is a prediction.

``--knob max_decode_batch`` sweeps the running-request cap per decode unit instead (the other
way a decode node's capacity can be limited); ``--engine KEY=VALUE`` fixes other engine
constants for every run.

Usage:
    .venv/bin/python bench/planner/calibrate_decode.py [--jobs 2] \
        [--knob decode_mem_efficiency] [--values 0.15 0.175 0.2 ...] [--seeds 1] \
        [--engine prefill_efficiency=0.22 ...] [--out bench/planner/calibration_decode.json]
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

from pdd.hardware import PREFILL_ORDERS  # noqa: E402
from planner.api import run_case  # noqa: E402
from planner.scenario import case_configs, load_scenario  # noqa: E402

SIDES = ("prefill", "decode")
# The pool that must not bind on each side's run: the other side's pool is made ample.
AMPLE_ROLE = {"prefill": "main_decode", "decode": "prefill"}


def side_config(
    side: str,
    knob: str,
    value: float,
    seed: int,
    ample: int,
    engine_set: dict[str, Any],
    duration_s: float | None = None,
) -> dict[str, Any]:
    """The paper-bcr PDD case with one pool and the WAN line made ample."""
    config = copy.deepcopy(case_configs(load_scenario("paper-bcr"))["pdd"])
    engine = config["fleet"]["engine"]
    engine.update(engine_set)
    engine[knob] = value
    config["workload"]["seed"] = seed
    if duration_s is not None:
        config["workload"]["duration_s"] = duration_s
    # MD's own capacity: with the full-MD rule RLD would take MD's slot queue and the
    # decode side would measure MD plus RLD (the balance was measured without it).
    config["fleet"].setdefault("policy", {})["relay_when_main_saturated"] = False
    for pool in config["fleet"]["pools"]:
        if pool["role"] == AMPLE_ROLE[side]:
            pool["count"] *= ample
    for link in config["fleet"]["links"].values():
        link["bandwidth_gbps"] *= ample
        link["pool_size"] *= ample
    return config


def _run(
    point: tuple[str, str, float, int, int, dict[str, Any], float | None],
) -> dict[str, Any]:
    side, knob, value, seed, ample, engine_set, duration_s = point
    config = side_config(side, knob, value, seed, ample, engine_set, duration_s)
    start = time.perf_counter()
    # paper-bcr's own goodput search (doubling, then bisection to its rel_tol).
    found = run_case(side, config, "fleet").goodput
    at = found["at"]
    return {
        "side": side,
        knob: value,
        "seed": seed,
        "goodput_rps": found["goodput_rps"],
        "drawn_rps": found.get("drawn_rps"),
        "ttft_p90": at["ttft_s"]["p90"],
        "ttft_p99": at["ttft_s"]["p99"],
        "runs": found["runs"],
        "wall_s": time.perf_counter() - start,
    }


def balance(rows: list[dict[str, Any]], knob: str = "decode_mem_efficiency") -> float | None:
    """Knob value where decode-side goodput meets prefill-side goodput (None if not bracketed)."""
    pts = sorted((r[knob], r["decode"] - r["prefill"]) for r in rows)
    for (e0, d0), (e1, d1) in itertools.pairwise(pts):
        if d0 == 0:
            return e0
        if d0 * d1 < 0 or d1 == 0:
            return e0 + (e1 - e0) * (-d0) / (d1 - d0)
    return None


KNOBS = ("decode_mem_efficiency", "max_decode_batch")


def check_duration(ap: argparse.ArgumentParser, duration_s: float | None, scenario: str,
                   case: str) -> None:  # fmt: skip
    """``--duration`` (also calibrate_load.py's) must outlast the case's warm-up."""
    warmup = case_configs(load_scenario(scenario))[case].get("warmup_s", 60.0)
    if duration_s is not None and not duration_s > warmup:
        ap.error(f"--duration: must be longer than the warm-up ({warmup:g} s)")


def engine_override(text: str) -> tuple[str, float | str]:
    """Parse one ``--engine KEY=VALUE`` (also used by calibrate_load.py)."""
    key, sep, value = text.partition("=")
    if not sep or key not in ("prefill_efficiency", "prefill_order", *KNOBS):
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected prefill_efficiency=V, decode_mem_efficiency=V, "
            f"max_decode_batch=N or prefill_order={'|'.join(PREFILL_ORDERS)}"
        )
    if key == "prefill_order":
        if value not in PREFILL_ORDERS:
            raise argparse.ArgumentTypeError(
                f"{text!r}: prefill_order is one of {', '.join(PREFILL_ORDERS)}"
            )
        return key, value
    try:
        number = int(value) if key == "max_decode_batch" else float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: {value!r} is not a number") from None
    if number <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be > 0")
    return key, number


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--knob", choices=KNOBS, default="decode_mem_efficiency",
                    help="the decode constant to sweep")  # fmt: skip
    ap.add_argument(
        "--values", "--eff", dest="values", type=float, nargs="+",
        default=[0.15, 0.175, 0.2, 0.225, 0.25],
        help="grid of the knob's values (integers for max_decode_batch)",
    )  # fmt: skip
    ap.add_argument("--seeds", type=int, nargs="+", default=[1])
    ap.add_argument("--ample", type=int, default=4, help="multiplier for the non-binding side")
    ap.add_argument(
        "--engine", type=engine_override, nargs="*", default=[], metavar="KEY=VALUE",
        help="engine overrides for every run, e.g. prefill_efficiency=0.22",
    )  # fmt: skip
    ap.add_argument(
        "--duration", type=float, default=None,
        help="seconds of traffic per goodput-search step (default: paper-bcr's)",
    )  # fmt: skip
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    knob = args.knob
    check_duration(ap, args.duration, "paper-bcr", "pdd")
    if knob == "max_decode_batch":
        if any(v < 1 or v != int(v) for v in args.values):
            ap.error("--values: max_decode_batch values must be positive integers")
        values: list[float] = [int(v) for v in args.values]
    else:
        if any(not 0 < v <= 1 for v in args.values):
            ap.error("--values: efficiencies must be in (0, 1]")
        values = list(args.values)
    if args.ample < 2:
        ap.error("--ample: must be >= 2")
    engine_set = dict(args.engine)
    if knob in engine_set:
        ap.error(f"--engine: {knob} is the swept knob")
    grid = [
        (side, knob, value, seed, args.ample, engine_set, args.duration)
        for side, value, seed in itertools.product(SIDES, values, args.seeds)
    ]
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        runs = list(pool.map(_run, grid))
    rows = []
    for value in values:
        row: dict[str, Any] = {knob: value}
        for side in SIDES:
            mine = [r["goodput_rps"] for r in runs if r["side"] == side and r[knob] == value]
            row[side] = float(np.mean(mine))
        row["ratio"] = row["decode"] / row["prefill"] if row["prefill"] else None
        rows.append(row)
    overrides = ", ".join(f"{k} {v}" for k, v in engine_set.items()) or "none"
    print("goodput (received RPS) of the paper-bcr PDD fleet with the other side ample "
          f"(x{args.ample}), seeds {args.seeds}, engine overrides: {overrides}"
          + (f", {args.duration:g} s per step" if args.duration is not None else ""))  # fmt: skip
    print(f"{knob:>21} | {'P-bound (40 P)':>14} | {'MD-bound (32 MD)':>16} | MD / P")
    for row in rows:
        ratio = f"{row['ratio']:.2f}" if row["ratio"] is not None else "-"
        print(f"{row[knob]:>21.3f} | {row['prefill']:>14.1f} | "
              f"{row['decode']:>16.1f} | {ratio}")  # fmt: skip
    chosen = balance(rows, knob)
    if chosen is None:
        print("the grid does not bracket the balance: widen --values")
    else:
        print(f"balanced at {knob} {chosen:.3f}")
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {
                    "knob": knob,
                    "ample": args.ample,
                    "seeds": args.seeds,
                    "engine": engine_set,
                    "duration_s": args.duration,
                    "runs": runs,
                    "rows": rows,
                    "balanced": chosen,
                },
                indent=2,
            )
            + "\n"
        )
    return 0 if chosen is not None else 1


if __name__ == "__main__":
    raise SystemExit(main())
