"""Re-price a hit-rate sweep at other tariffs: what each fleet's goodput earns per unit-hour.

A run's revenue depends on the tariff only through the mean request's billed tokens (uncached
input, cached input, output), which every sweep point stores (``at.billed_tokens``), so any
tariff can be applied to a committed sweep without simulating again:

    python bench/planner/bathtub_tariffs.py bench/planner/bathtub/sweep.json
    python bench/planner/bathtub_tariffs.py RESULT --cached 0.1 0.25 --output 1.5 4 5 --json OUT

For each tariff (cached-input fraction x output/input price ratio, input at 1 per million) it
prints revenue per unit-hour of hardware at every hit rate, for every case, and the curve's
shape: its low end (first point), its valley (the lowest point between the ends), its high end
(last point), and each end over the valley.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from planner.metrics import Tariff, revenue  # noqa: E402


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
        print(f"bathtub_tariffs: {exc}", file=sys.stderr)
        return 2
    print(render(priced))
    if args.json:
        args.json.write_text(json.dumps(priced, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
