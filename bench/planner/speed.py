"""Speed check: one hour of agentic traffic at 80 requests/s through the PDD simulator.

The issue's target: ~290k requests simulate in under a minute on one core. Times trace
generation and the simulation separately (wall clock, one process), on the ``paper-ttft`` PDD
fleet with the rate set to 80 RPS and the duration to 3,600 s.

Usage:
    .venv/bin/python bench/planner/speed.py [--rps 80] [--duration 3600] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from planner.api import make_trace, run_fleet  # noqa: E402
from planner.fleet import fleet_from_dict  # noqa: E402
from planner.metrics import Sla  # noqa: E402
from planner.scenario import case_configs, deep_merge, load_scenario  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rps", type=float, default=80.0)
    ap.add_argument("--duration", type=float, default=3600.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.rps <= 0 or args.duration <= 0:
        ap.error("--rps and --duration must be > 0")
    config = deep_merge(
        case_configs(load_scenario("paper-ttft"))["pdd"],
        # One hour of traffic is the figure: no settle span before it.
        {"workload": {"rps": args.rps, "duration_s": args.duration, "settle_s": 0}},
    )
    t0 = time.perf_counter()
    trace = make_trace(config)
    t1 = time.perf_counter()
    summary, _ = run_fleet(fleet_from_dict(config["fleet"]), trace, Sla(), 60.0)
    t2 = time.perf_counter()
    result = {
        "requests": len(trace),
        "rps": args.rps,
        "duration_s": args.duration,
        "trace_s": round(t1 - t0, 2),
        "simulate_s": round(t2 - t1, 2),
        "total_s": round(t2 - t0, 2),
        "ttft_p90_s": summary["ttft_s"]["p90"],
        "python": platform.python_version(),
        "machine": platform.machine(),
    }
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
