"""Command line: ``python -m planner {list,run,plan}``; bad input gives one line and exit 2."""

from __future__ import annotations

import argparse
import json
import math
import os
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
    result = simulate(args.scenario, jobs=args.jobs)
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
    run.set_defaults(func=_cmd_run)
    plan = sub.add_parser("plan", help="search pool counts for the best BCR under the SLA")
    plan.add_argument("scenario")
    plan.add_argument("--top", type=int, default=5)
    plan.set_defaults(func=_cmd_plan)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
