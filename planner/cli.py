"""Command line: ``python -m planner {list,run,plan,size}``; bad input gives one line and exit 2."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def default_out(scenario: str) -> Path:
    """Where `planner run` writes without `--out`: `var/planner/<scenario>` (under
    `$BATON_VAR_DIR` when set), never over the results committed in `bench/planner/`."""
    var = Path(os.environ.get("BATON_VAR_DIR") or ROOT / "var")
    name = scenario.rsplit("/", 1)[-1].removesuffix(".json") or "scenario"
    return var / "planner" / name


def _clean(value: Any) -> Any:
    # JSON has no NaN/inf: write them as null so every consumer can parse the output.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def _cmd_list(_: argparse.Namespace) -> int:
    from planner.scenario import list_scenarios

    for name, description in list_scenarios():
        print(f"{name:20s} {description}")
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from planner.api import simulate

    if args.jobs < 1:
        raise ValueError(f"--jobs: must be >= 1, got {args.jobs}")
    result = simulate(
        args.scenario,
        jobs=args.jobs,
        band_pct=args.band,
        constants_pct=args.constants,
        seeds=args.seeds,
    )
    out = Path(args.out) if args.out else default_out(result.scenario)
    out.mkdir(parents=True, exist_ok=True)
    data = _clean(result.to_dict())
    (out / "result.json").write_text(json.dumps(data, indent=2))
    if not args.no_plots:
        from planner.plots import plot_result

        for path in plot_result(result, out):
            print(f"wrote {path}")
    brief = {
        name: {k: v for k, v in c["summary"].items() if k != "series"} | {"goodput": c["goodput"]}
        for name, c in data["cases"].items()
    }
    print(json.dumps(brief if not result.sweep else data["sweep"], indent=1)[:20000])
    print(f"wrote {out / 'result.json'}")
    from planner.bands import RULE, describe

    banded = [(n, c["summary"]["band"]) for n, c in data["cases"].items() if "band" in c["summary"]]
    for name, b in banded:
        print(describe(name, b))
    if banded:
        print(f"({RULE})")
    for line in data.get("warnings", []):
        print(f"warning: {line}", file=sys.stderr)
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from planner.api import plan
    from planner.scenario import case_configs, load_scenario

    data = load_scenario(args.scenario)
    if "search_space" not in data:
        raise ValueError(f"{args.scenario}: scenario has no search_space to plan over")
    config = next(iter(case_configs(data).values()))
    results = plan(
        config["fleet"], config.get("workload", {}), config.get("sla", {}), data["search_space"],
        top=args.top, tariff=config.get("tariff"),
    )  # fmt: skip
    print(json.dumps(_clean([r.to_dict() for r in results]), indent=1))
    return 0


# `size --from-db` reads the database's fleet from the control plane's command line: the
# planner imports no Django, so the control plane composes the fleet and prints it as JSON.
DB_FLEET_COMMAND = "planner_fleet"


def _manage(*args: str) -> subprocess.CompletedProcess[str]:
    """Run ``manage.py ARGS`` (the control plane's command line, with this environment)."""
    command = [sys.executable, str(ROOT / "manage.py"), *args]
    return subprocess.run(command, capture_output=True, text=True, check=False)


def _db_fleet(scenario: str) -> dict[str, Any]:
    """The fleet in the database as a planner fleet: ``manage.py planner_fleet SCENARIO``
    (``plans.services.planner_fleet_from_db``: GPU types, prices and the WAN link from the
    inventory, the pools the nodes now running each role). A refusal (no WAN link, an unknown
    scenario) is a ValueError with its message, as any other bad input."""
    done = _manage(DB_FLEET_COMMAND, scenario)
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        last = lines[-1] if lines else f"exit status {done.returncode}"
        if not last.startswith("CommandError: "):
            sys.stderr.write(done.stderr)  # not a refusal: show the whole story
        raise ValueError(last.removeprefix("CommandError: "))
    fleet: dict[str, Any] = json.loads(done.stdout)
    return fleet


def _figure(value: Any) -> str:
    return "inf" if value is None or value == math.inf else f"{value:.3g}"


def _cmd_size(args: argparse.Namespace) -> int:
    from planner.bands import describe
    from planner.size import Progress, size

    fleet = _db_fleet(args.scenario) if args.from_db else None
    sla = {}
    if args.p90 is not None:
        sla["ttft_p90_s"] = args.p90
    if args.p99 is not None:
        sla["ttft_p99_s"] = args.p99
    workload = {}
    if args.duration is not None:
        workload["duration_s"] = args.duration
    if args.settle is not None:
        workload["settle_s"] = args.settle
    scan = [float(x) for x in args.bcr_scan.split(",") if x.strip()] if args.bcr_scan else []
    enabled = None if args.progress == "auto" else args.progress == "on"
    result = size(
        args.scenario, args.rps, case=args.case, fleet=fleet, sla=sla or None,
        workload=workload or None, workers=args.workers, bcr_scan=scan, band_pct=args.band,
        constants_pct=args.constants, seeds=args.seeds,
        progress=Progress(enabled=enabled),
    )  # fmt: skip
    if args.json:
        print(json.dumps(_clean(result), indent=1))
        return 0
    best = result["cheapest"]
    sla_text = ", ".join(f"{k} < {v:g}" for k, v in result["sla"].items() if not k.startswith("_"))
    print(f"{result['scenario']} ({result['case']}) at {result['rps']:g} RPS, SLA {sla_text}")
    print("unit prices: " + ", ".join(f"{g} {p:g}/h" for g, p in result["unit_prices"].items()))
    if not best["found"]:
        print(f"no fleet found: {best['reason']}")
        return 1
    print(f"cheapest fleet (cost {best['cost_per_hour']:g}/h):")
    for key, count in best["counts"].items():
        fewer = best["one_fewer"].get(key)
        note = ""
        if fewer is not None:
            verdict = "meets" if fewer["met"] else "breaks"
            # A run stopped once the SLA could not be met: its figures are lower bounds.
            ge = ">= " if fewer.get("stopped") else ""
            note = (
                f"  one fewer {verdict} the SLA (P90 {ge}{_figure(fewer['ttft_p90_s'])} s, "
                f"P99 {ge}{_figure(fewer['ttft_p99_s'])} s)"
            )
        print(f"  {key:28s} {count:4d}{note}")
    at = best["at"]
    print(
        f"  at {result['rps']:g} RPS: P90 TTFT {_figure(at['ttft_p90_s'])} s, "
        f"P99 {_figure(at['ttft_p99_s'])} s"
    )
    if "band" in best:
        print("  " + describe("band", best["band"]))
        print(f"  ({best['band']['rule']})")
    if "max_bcr" in result:
        top = result["max_bcr"]["best"]
        counts = ", ".join(f"{k} {v}" for k, v in top["counts"].items())
        print(
            f"max-BCR fleet: {counts}: goodput {top['goodput_rps']:.3g} RPS received "
            f"(SLA held up to {top['bracket'][0]:.3g} RPS drawn, not at "
            f"{top['bracket'][1]:.3g}), cost "
            f"{top['cost_per_hour']:g}/h, BCR {top['bcr']:.3g}"
        )
    print(
        f"{result['runs']} simulations on {result['workers']} workers, {result['wall_s']:.1f} s "
        f"({result.get('simulator', 'pure Python')} simulator)"
    )
    return 0


def _cmd_native(args: argparse.Namespace) -> int:
    from planner import native

    if args.action == "build":
        return native.build()
    print(f"{native.state}: {native.reason}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m planner", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="list bundled scenarios").set_defaults(func=_cmd_list)
    run = sub.add_parser("run", help="simulate a scenario (name or path)")
    run.add_argument("scenario")
    run.add_argument(
        "--out",
        help="output folder (default var/planner/<scenario>; the committed results in "
        "bench/planner/<scenario> are refreshed with --out bench/planner/<scenario>)",
    )
    run.add_argument("--no-plots", action="store_true")
    run.add_argument("--jobs", type=int, default=1,
                     help="processes to run cases on (same results as one)")  # fmt: skip
    run.add_argument("--band", type=float, default=5.0,
                     help="also run each single-rate case at +-PCT%% and +-1%% rate and report "
                     "its band and cliff flag (default 5; 0 = none)")  # fmt: skip
    run.add_argument("--constants", type=float, default=0.0,
                     help="also scale the fitted engine constants by +-PCT%% (0 = no)")  # fmt: skip
    run.add_argument("--seeds", type=int, default=0,
                     help="also run each single-rate case on N other seeds")  # fmt: skip
    run.set_defaults(func=_cmd_run)
    plan = sub.add_parser("plan", help="search pool counts for the best BCR under the SLA")
    plan.add_argument("scenario")
    plan.add_argument("--top", type=int, default=5)
    plan.set_defaults(func=_cmd_plan)
    sz = sub.add_parser(
        "size",
        help="the cheapest fleet meeting the SLA at a rate, and the max-BCR fleet",
        description="Per-pool bisection from the scenario's fleet (or the database's): the "
        "cheapest fleet meeting the SLA at --rps, its band over the rate and fitted constants, "
        "and the best-BCR fleet among the cheapest at --bcr-scan multiples of the rate.",
    )
    sz.add_argument("scenario")
    sz.add_argument("--rps", type=float, help="target rate (default: the scenario's)")
    sz.add_argument("--case", help="which case to size (default: its pdd case, else the first)")
    sz.add_argument("--p90", type=float, help="SLA: P90 TTFT below this many seconds")
    sz.add_argument("--p99", type=float, help="SLA: P99 TTFT below this many seconds")
    sz.add_argument("--duration", type=float,
                    help="simulated seconds measured per run (default: scenario's)")  # fmt: skip
    sz.add_argument("--settle", type=float,
                    help="simulated settle seconds before those (default: scenario's)")  # fmt: skip
    sz.add_argument("--workers", type=int, help="processes (default: the available cores)")
    sz.add_argument(
        "--bcr-scan",
        default="0.5,1,2",
        help="multiples of --rps whose cheapest fleets compete on BCR ('' = none)",
    )
    sz.add_argument("--band", type=float, default=5.0, help="rate band, percent (0 = none)")
    sz.add_argument("--constants", type=float, default=5.0,
                    help="band over the fitted engine constants, percent (0 = none)")  # fmt: skip
    sz.add_argument("--seeds", type=int, default=2,
                    help="other seeds run at the rate: the sampling spread")  # fmt: skip
    sz.add_argument(
        "--from-db",
        action="store_true",
        help="start from the fleet in the database (its GPU types, prices, link)",
    )
    sz.add_argument("--progress", choices=("auto", "on", "off"), default="auto",
                    help="progress bar on stderr (auto: only on a terminal)")  # fmt: skip
    sz.add_argument("--json", action="store_true")
    sz.set_defaults(func=_cmd_size)
    nat = sub.add_parser(
        "native",
        help="compile the simulator with mypyc (build), or say whether it runs compiled (status)",
        description="The simulator's hot modules compiled to C (planner/native.py): the same "
        "results, faster; used only while the build matches the sources.",
    )
    nat.add_argument("action", choices=("build", "status"))
    nat.set_defaults(func=_cmd_native)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
