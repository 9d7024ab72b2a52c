"""The planner's results, regenerated and published: the tool `make -C bench/planner` runs.

    .venv/bin/python -m bench.planner.results seeds SCENARIO --reference CASE --seeds 1 2 3 \\
        [--jobs 2] [--rps 78] [--out var/planner/ttft-seeds/78rps.json]
    .venv/bin/python -m bench.planner.results tariffs bench/planner/bathtub/sweep.json \\
        [--cached 0.1 0.25] [--output 1.5 4 5] [--json OUT]
    .venv/bin/python -m bench.planner.results publish [--var var/planner] [--out bench/planner]

``seeds`` runs a scenario's cases over several seeds: TTFT percentiles, RLD token share, and
each case's cut against a reference case (seed by seed, then the mean).

``tariffs`` re-prices a hit-rate sweep: what each fleet's goodput earns per unit-hour. A run's
revenue depends on the tariff only through the mean request's billed tokens (uncached input,
cached input, output), which every sweep point stores (``at.billed_tokens``), so any tariff can
be applied to a committed sweep without simulating again. For each tariff (cached-input fraction
x output/input price ratio, input at 1 per million) it prints revenue per unit-hour of hardware
at every hit rate, for every case, and the curve's shape: its low end (first point), its valley
(the lowest point between the ends), its high end (last point), and each end over the valley.

``publish`` condenses the regenerated results (var/planner/, untracked) into the small summaries
committed here: ``summaries.json`` (every headline scenario's cases: summary, goodput, wall
time; the per-second series are dropped), ``bathtub/sweep.json`` (the hit-rate sweep, what
``tariffs`` reads) and ``ttft-seeds.json`` (``make ttft-seeds``' rate scan, keyed by rate) from
whichever of ``<var>/<scenario>/result.json`` and ``<var>/ttft-seeds/<r>rps.json`` exist; a
scenario or rate not regenerated keeps its committed entry.
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

from pdd.vocab import Pipeline
from planner.api import run_case
from planner.metrics import TTFT_PARTS, Tariff, revenue
from planner.scenario import case_configs, load_scenario

PROG = "python -m bench.planner.results"
ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = ["paper-microbench", "paper-ttft", "paper-token-share", "paper-bcr", "p-rld-collapse"]
KEEP = ("summary", "goodput", "wall_s")


# -- seeds: a scenario's cases over several seeds -----------------------------------------------


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


def seeds(argv: list[str] | None = None) -> int:
    """Run a scenario's cases over several seeds: TTFT percentiles, RLD token share, and each
    case's cut against a reference case (seed by seed, then the mean)."""
    ap = argparse.ArgumentParser(prog=f"{PROG} seeds", description=seeds.__doc__)
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


# -- tariffs: a hit-rate sweep re-priced ----------------------------------------------------


def load_sweep(path: Path) -> list[dict[str, Any]]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot read a result ({exc})") from exc
    sweep = data.get("sweep") if isinstance(data, dict) else None
    if not sweep:
        raise ValueError(f"{path}: not a sweep result (no 'sweep' rows)")
    for row in sweep:
        for name, point in row.items():
            if name != "value" and "billed_tokens" not in point.get("at", {}):
                raise ValueError(
                    f"{path}: {name} at {row['value']} has no billed_tokens (a run from before "
                    "the planner priced requests; run the scenario again)"
                )
    return sweep


def shape(values: list[float]) -> dict[str, float]:
    """Low end, valley (lowest interior point), high end, and each end over the valley."""
    inner = values[1:-1] or values
    valley = min(inner)
    at = values.index(valley)
    return {
        "low_end": values[0],
        "valley": valley,
        "valley_at_index": at,
        "high_end": values[-1],
        "low_over_valley": values[0] / valley if valley else float("inf"),
        "high_over_valley": values[-1] / valley if valley else float("inf"),
    }


def price(
    sweep: list[dict[str, Any]], cached: list[float], output: list[float]
) -> list[dict[str, Any]]:
    names = [k for k in sweep[0] if k != "value"]
    hits = [row["value"] for row in sweep]
    out = []
    for fraction in cached:
        for ratio in output:
            tariff = Tariff(1.0, fraction, ratio)
            curves = {}
            for name in names:
                ys = []
                for row in sweep:
                    point = row[name]
                    r = revenue(
                        tariff, point["at"]["billed_tokens"], point["goodput_rps"],
                        point["cost_per_hour"],
                    )  # fmt: skip
                    ys.append(r["per_cost"])
                curves[name] = {"per_cost": ys, "shape": shape(ys)}
            out.append(
                {
                    "cached_input_fraction": fraction,
                    "output_ratio": ratio,
                    "hits": hits,
                    "cases": curves,
                }  # fmt: skip
            )
    return out


def render(priced: list[dict[str, Any]]) -> str:
    lines = []
    for block in priced:
        hits = block["hits"]
        lines.append(
            f"## cached input at {block['cached_input_fraction']:.0%}, output at "
            f"{block['output_ratio']:g}x input (revenue per unit-hour of hardware)"
        )
        lines.append(
            "| case | " + " | ".join(f"{h:g}" for h in hits) + " | low/valley | high/valley |"
        )
        lines.append("|---" * (len(hits) + 3) + "|")
        for name, curve in block["cases"].items():
            s = curve["shape"]
            lines.append(
                f"| {name} | "
                + " | ".join(f"{v:.1f}" for v in curve["per_cost"])
                + f" | {s['low_over_valley']:.2f} (valley at {hits[s['valley_at_index']]:g})"
                + f" | {s['high_over_valley']:.2f} |"
            )
        lines.append("")
    return "\n".join(lines)


def tariffs(argv: list[str] | None = None) -> int:
    """Re-price a hit-rate sweep at other tariffs (see the module's docstring)."""
    parser = argparse.ArgumentParser(prog=f"{PROG} tariffs", description=tariffs.__doc__)
    parser.add_argument("result", type=Path, help="a sweep's result.json")
    parser.add_argument(
        "--cached",
        type=float,
        nargs="+",
        default=[0.1, 0.25],
        help="cached-input fractions of the input price (docs/pdd.md: 0.10-0.25)",
    )
    parser.add_argument(
        "--output",
        type=float,
        nargs="+",
        default=[1.5, 4.0, 5.0],
        help="output price as a multiple of the uncached input price",
    )
    parser.add_argument("--json", type=Path, help="also write the priced curves here")
    args = parser.parse_args(argv)
    try:
        sweep = load_sweep(args.result)
        priced = price(sweep, args.cached, args.output)
    except ValueError as exc:
        print(f"tariffs: {exc}", file=sys.stderr)
        return 2
    print(render(priced))
    if args.json:
        args.json.write_text(json.dumps(priced, indent=1) + "\n")
    return 0


# -- publish: var/planner/ into the committed summaries ----------------------------------------


def condense(result: dict[str, Any]) -> dict[str, Any]:
    cases = {
        name: {k: case[k] for k in KEEP if k in case} for name, case in result["cases"].items()
    }
    return {"scenario": result.get("scenario"), "kind": result.get("kind"), "cases": cases}


def _load(path: Path) -> Any:
    return json.loads(path.read_text()) if path.exists() else {}


def _dump(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, sort_keys=True) + "\n")


def publish(argv: list[str] | None = None) -> int:
    """Condense var/planner/ into the committed summaries (see the module's docstring)."""
    ap = argparse.ArgumentParser(prog=f"{PROG} publish", description=publish.__doc__)
    ap.add_argument("--var", type=Path, default=ROOT / "var" / "planner")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "planner")
    args = ap.parse_args(argv)

    summaries = _load(args.out / "summaries.json")
    for name in SCENARIOS:
        path = args.var / name / "result.json"
        if path.exists():
            summaries[name] = condense(json.loads(path.read_text()))
            print(f"summaries.json: {name}")
    _dump(args.out / "summaries.json", summaries)

    bathtub = args.var / "bathtub" / "result.json"
    if bathtub.exists():
        data = json.loads(bathtub.read_text())
        keep = {k: data.get(k) for k in ("scenario", "kind", "sweep")}
        _dump(args.out / "bathtub" / "sweep.json", keep)
        print("bathtub/sweep.json")

    scan = _load(args.out / "ttft-seeds.json")
    for path in sorted((args.var / "ttft-seeds").glob("*rps.json")):
        scan[path.stem.removesuffix("rps")] = json.loads(path.read_text())
        print(f"ttft-seeds.json: {path.stem}")
    _dump(args.out / "ttft-seeds.json", scan)
    return 0


COMMANDS = {"seeds": seeds, "tariffs": tariffs, "publish": publish}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]):
        print(f"usage: {PROG} {{{','.join(COMMANDS)}}} ...\n\n{__doc__}")
        return 0
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: {PROG} {{{','.join(COMMANDS)}}} ...\n\n{__doc__}", file=sys.stderr)
        return 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
