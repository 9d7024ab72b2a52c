"""Simulator speed, before and after: simulated requests per second on one core, interleaved.

Runs the same simulation with the planner of a git revision (A, exported with ``git archive``
into ``var/planner/speed/<rev>/``), with this working tree as pure Python (B,
``BATON_PLANNER_NATIVE=0``) and with this tree's compiled build (C, planner/native.py; skipped
with a note where none is current), alternately A, B, C, A, B, C, ... in fresh processes
pinned to one core, and reports each side's median, min and max of simulated requests per
wall second (and per CPU second: less sensitive to other load on a shared machine). Every run
prints a digest of its per-request records; all sides must agree (the speed work changed no
result), or the script says so and exits 1.

The default simulation is paper-ttft's ``pdd`` case as ``planner run`` runs it: 80 RPS, one
hour of settling, then 1,800 measured seconds (425,898 requests). ``--settle 0 --duration
3600`` is the earlier figure's run (one hour of traffic, 283,650 requests).

``--size`` also times the sizing question "cheapest fleet for P90 TTFT < 10 s, P99 < 15 s at
100 RPS" (``planner size paper-ttft --rps 100 --duration 300 --settle 900 --bcr-scan ''
--constants 0 --seeds 0``, on ``--size-workers``, default all cores) with this tree,
``--size-reps`` times (default 1), compiled and pure Python alternately.

Usage:
    .venv/bin/python bench/planner/speed.py [--ref REV] [--reps 3] [--settle S --duration S]
        [--size] [--out var/planner/speed.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BEFORE = "14d0086"  # the last commit before the simulator's speed work (issue 26)

# Run in a fresh process with PYTHONPATH set to the tree under test.
SNIPPET = r"""
import hashlib, json, sys, time
import numpy as np
from planner.api import make_trace
from planner.fleet import fleet_from_dict
from planner.scenario import case_configs, deep_merge, load_scenario
from planner.sim import Simulator
import planner
case = sys.argv[1]
rps, duration, settle = (float(x) for x in sys.argv[2:5])
config = deep_merge(case_configs(load_scenario("paper-ttft"))[case],
                    {"workload": {"rps": rps, "duration_s": duration, "settle_s": settle}})
trace = make_trace(config)
sim = Simulator(fleet_from_dict(config["fleet"]))
wall, cpu = time.perf_counter(), time.process_time()
rec = sim.run(trace)
wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
h = hashlib.sha256()
for name in ("arrival_s", "ttft_s", "finish_s", "wan_s", "wan_wait_s", "pipeline", "handoff",
             "rld_tokens", "md_tokens", "md_hit_tokens", "md_kv_at_s", "prefill_done_s",
             "first_kv_s", "first_start_s"):
    h.update(np.ascontiguousarray(getattr(rec, name)).tobytes())
h.update(json.dumps(rec.series, sort_keys=True).encode())
native = getattr(getattr(planner, "_native", None), "state", "absent")
print(json.dumps({"requests": len(trace), "wall_s": wall, "cpu_s": cpu,
                  "digest": h.hexdigest()[:16], "native": native}))
"""


def export(rev: str, dest: Path) -> Path:
    """The planner, routing and pdd packages of ``rev``, unpacked under ``dest`` (once)."""
    sha = subprocess.run(
        ["git", "rev-parse", "--short", rev], cwd=ROOT, check=True, capture_output=True,
        text=True,
    ).stdout.strip()  # fmt: skip
    tree = dest / sha
    if not (tree / "planner").is_dir():
        tree.mkdir(parents=True, exist_ok=True)
        tar = tree / "src.tar"
        with open(tar, "wb") as out:
            subprocess.run(["git", "archive", sha, "planner", "routing", "pdd"], cwd=ROOT,
                           check=True, stdout=out)  # fmt: skip
        with tarfile.open(tar) as t:
            t.extractall(tree, filter="data")
        tar.unlink()
    return tree


def one_core() -> int:
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
    return cores[-1]


def measure(tree: Path, args: argparse.Namespace, core: int, native: bool) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1",
               BATON_PLANNER_NATIVE="1" if native else "0")  # fmt: skip

    def pin() -> None:
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, {core})

    out = subprocess.run(
        [sys.executable, "-c", SNIPPET, args.case, str(args.rps), str(args.duration),
         str(args.settle)],
        cwd=tree, env=env, check=True, capture_output=True, text=True, preexec_fn=pin,
    ).stdout  # fmt: skip
    run = json.loads(out.strip().splitlines()[-1])
    run["req_per_wall_s"] = run["requests"] / run["wall_s"]
    run["req_per_cpu_s"] = run["requests"] / run["cpu_s"]
    return run


def stats(values: list[float]) -> dict:
    median = statistics.median(values)
    spread = (max(values) - min(values)) / median * 100
    return {"median": median, "min": min(values), "max": max(values), "spread_pct": spread}


def native_state() -> str:
    out = subprocess.run([sys.executable, "-m", "planner", "native", "status"], cwd=ROOT,
                         capture_output=True, text=True)  # fmt: skip
    return out.stdout.strip().split(":")[0] or "unknown"


def size_question(workers: int | None, native: bool) -> dict:
    cmd = [sys.executable, "-m", "planner", "size", "paper-ttft", "--rps", "100", "--duration",
           "300", "--settle", "900", "--bcr-scan", "", "--constants", "0", "--seeds", "0",
           "--progress", "off", "--json"]  # fmt: skip
    if workers:
        cmd += ["--workers", str(workers)]
    start = time.perf_counter()
    env = dict(os.environ, BATON_PLANNER_NATIVE="1" if native else "0")
    out = subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True,
                         text=True).stdout  # fmt: skip
    wall = time.perf_counter() - start
    result = json.loads(out)
    best = result["cheapest"]
    return {
        "command": "python -m planner size " + " ".join(c or "''" for c in cmd[4:]),
        "compiled": native,
        "wall_s": wall,
        "runs": result["runs"],
        "workers": result["workers"],
        "counts": best.get("counts"),
        "cost_per_hour": best.get("cost_per_hour"),
        "ttft_p90_s": best.get("at", {}).get("ttft_p90_s"),
        "ttft_p99_s": best.get("at", {}).get("ttft_p99_s"),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ref", default=BEFORE, help=f"the 'before' revision (default {BEFORE})")
    ap.add_argument("--reps", type=int, default=3, help="runs of each side (default 3)")
    ap.add_argument("--case", default="pdd")
    ap.add_argument("--rps", type=float, default=80.0)
    ap.add_argument("--duration", type=float, default=1800.0)
    ap.add_argument("--settle", type=float, default=3600.0)
    ap.add_argument("--size", action="store_true", help="also time the 100-RPS sizing question")
    ap.add_argument("--size-workers", type=int, default=None)
    ap.add_argument(
        "--size-reps",
        type=int,
        default=1,
        help="times the sizing question runs compiled and pure Python, alternately",
    )
    ap.add_argument("--out", default=str(ROOT / "var" / "planner" / "speed.json"))
    args = ap.parse_args(argv)
    if args.reps < 1 or args.rps <= 0 or args.duration <= 0 or args.settle < 0:
        ap.error("--reps >= 1, --rps and --duration > 0, --settle >= 0")
    compiled = native_state() == "native"
    if not compiled:
        print("no current compiled build (make setup builds it): side C skipped",
              file=sys.stderr)  # fmt: skip
    a_tree = export(args.ref, ROOT / "var" / "planner" / "speed")
    sides = {"A": (a_tree, False), "B": (ROOT, False)} | ({"C": (ROOT, True)} if compiled else {})
    core = one_core()
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    for rep in range(args.reps):
        for side, (tree, native) in sides.items():
            run = measure(tree, args, core, native)
            runs[side].append(run)
            print(f"rep {rep + 1} {side}: {run['requests']} requests, "
                  f"{run['req_per_wall_s']:,.0f} req/s wall, {run['req_per_cpu_s']:,.0f} "
                  f"req/s CPU, digest {run['digest']}", file=sys.stderr)  # fmt: skip
    digests = {r["digest"] for side in runs.values() for r in side}
    result = {
        "simulation": {
            "scenario": "paper-ttft",
            "case": args.case,
            "rps": args.rps,
            "duration_s": args.duration,
            "settle_s": args.settle,
            "requests": runs["B"][0]["requests"],
        },  # fmt: skip
        "A": {
            "rev": args.ref,
            **{k: stats([r[k] for r in runs["A"]]) for k in ("req_per_wall_s", "req_per_cpu_s")},
        },
        **{
            side: {
                "rev": "working tree" + (", compiled" if native else ", pure Python"),
                **{
                    k: stats([r[k] for r in runs[side]])
                    for k in ("req_per_wall_s", "req_per_cpu_s")
                },
            }
            for side, (_, native) in sides.items()
            if side != "A"
        },
        "order": f"{', '.join(sides)} in turn, fresh process each, pinned to core {core}",
        "identical_records": len(digests) == 1,
        "runs": runs,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cores": os.cpu_count(),
        "load_avg_at_end": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }
    for side in sides:
        if side != "A":
            result[f"speedup_median_wall_{side}_over_A"] = (
                result[side]["req_per_wall_s"]["median"] / result["A"]["req_per_wall_s"]["median"]
            )
    if args.size:
        result["size"] = [
            size_question(args.size_workers, native)
            for _ in range(max(args.size_reps, 1))
            for native in ([True, False] if compiled else [False])
        ]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
    if len(digests) != 1:
        print("the two sides' records differ", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
