"""Fixed log-spaced latency bins shared by every process, so histograms merge by adding counts.

Bins cover 0.1 ms .. 1000 s with 20 bins per decade: each bin is 12.2% wide and a percentile
read back as the bin's geometric midpoint is within 5.9% of the true value. Values below the
range land in the first bin, values above it in the last.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

MIN_S = 1e-4
BINS_PER_DECADE = 20
DECADES = 7
NUM_BINS = BINS_PER_DECADE * DECADES
# Relative half-width of a bin: the worst error of a percentile read from the bins.
RESOLUTION = 10 ** (1 / (2 * BINS_PER_DECADE)) - 1
# Prometheus buckets: every 5th bin edge (4 per decade) from 1 ms, so `le` counts are exact.
PROM_EDGE_STEP = 5
PROM_FIRST_EDGE_BIN = BINS_PER_DECADE  # 1e-3 s


def bin_index(value_s: float) -> int:
    """Bin of a latency in seconds; out-of-range values are clamped to the end bins."""
    if not value_s > MIN_S:
        return 0
    idx = int(math.log10(value_s / MIN_S) * BINS_PER_DECADE)
    return min(idx, NUM_BINS - 1)


def bin_lower(idx: int) -> float:
    return MIN_S * 10 ** (idx / BINS_PER_DECADE)


def bin_mid(idx: int) -> float:
    """Geometric midpoint of a bin: the value a percentile in this bin is reported as."""
    return MIN_S * 10 ** ((idx + 0.5) / BINS_PER_DECADE)


def percentile(counts: Mapping[int, int], q: float) -> float | None:
    """Nearest-rank percentile ``q`` (0..1) of a binned distribution; None when it is empty."""
    total = sum(counts.values())
    if total <= 0:
        return None
    rank = max(1, math.ceil(q * total))
    seen = 0
    for idx in sorted(counts):
        seen += counts[idx]
        if seen >= rank:
            return bin_mid(idx)
    return bin_mid(max(counts))


def prometheus_buckets(counts: Mapping[int, int]) -> list[tuple[str, int]]:
    """Cumulative (le, count) pairs for a Prometheus histogram, ending with +Inf."""
    edges = list(range(PROM_FIRST_EDGE_BIN, NUM_BINS + 1, PROM_EDGE_STEP))
    ordered = sorted(counts.items())
    out: list[tuple[str, int]] = []
    cumulative = 0
    pos = 0
    for edge in edges:
        while pos < len(ordered) and ordered[pos][0] < edge:
            cumulative += ordered[pos][1]
            pos += 1
        out.append((f"{bin_lower(edge):.6g}", cumulative))
    total = sum(counts.values())
    out.append(("+Inf", total))
    return out
