"""A benchmark's result: its rounds summarised, the result printed and written as JSON."""

from __future__ import annotations

import json
import statistics
from pathlib import Path


def spread(values: list[float], digits: int) -> dict[str, float]:
    """Median, min and max of a benchmark's rounds, rounded."""
    return {
        "median": round(statistics.median(values), digits),
        "min": round(min(values), digits),
        "max": round(max(values), digits),
    }


def publish(result: dict, out: Path | None) -> None:
    """Print a benchmark's result and write it to ``out`` (when given) as JSON."""
    print(json.dumps(result, indent=2))
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")


def pct(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile of `values` (None when empty)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
