"""The published PDD figures each bundled scenario is compared with (docs/pdd.md lists them
all, with their conditions), in the units the planner reports, for the plots to mark.

`BARS[scenario]` marks one bar of a percentile plot: (plot, case, quantile) -> (value, label);
`LINES[scenario]` draws a horizontal line across a plot: plot -> [(value, label)]; `VLINES`
a vertical one on a sweep's x axis. Plot names are the PNGs' stems (`ttft`, `transfer`,
`bathtub`, `token_share`)."""

from __future__ import annotations

# SLA for goodput: P90 TTFT < 10 s and P99 < 15 s.
SLA_LINES = [(10.0, "SLA P90 < 10 s"), (15.0, "SLA P99 < 15 s")]

BARS: dict[str, dict[tuple[str, str, str], tuple[float, str]]] = {
    "paper-ttft": {
        ("ttft", "in-dc-pd", "p50"): (4.2, "published in-DC PD median ~4.2 s"),
        ("ttft", "cdc-pd", "p50"): (6.7, "published cross-DC median ~6.7 s"),
        ("ttft", "cdc-pd", "p90"): (18.3, "published CDC-PD P90 18.3 s"),
        ("ttft", "cdc-pd", "p99"): (29.7, "published CDC-PD P99 29.7 s"),
        ("ttft", "pdd", "p90"): (9.8, "published PDD P90 9.8 s"),
        ("ttft", "pdd", "p99"): (14.4, "published PDD P99 14.4 s"),
    },
    "paper-microbench": {
        ("transfer", "skewed", "p50"): (0.248, "published skewed P50 248 ms"),
        ("transfer", "uniform", "p50"): (1.210, "published uniform P50 1,210 ms"),
    },
}

LINES: dict[str, dict[str, list[tuple[float, str]]]] = {
    "paper-ttft": {"ttft": SLA_LINES},
    "paper-bcr": {"ttft": SLA_LINES},
    "paper-microbench": {"transfer": [(18.0, "published skewed tail > 18 s")]},
    "paper-token-share": {"token_share": [(0.062, "published RLD share 6.2%")]},
    # PDD over IDC-PD at the production trace's ~90% mean hit.
    "bathtub": {"bathtub_ratio": [(1.375, "published BCR ratio 1.375 (+37.5%)")]},
}

VLINES: dict[str, dict[str, list[tuple[float, str]]]] = {
    "bathtub": {"bathtub": [(0.2, "published dips"), (0.4, ""), (0.7, "")]},
}


def _key(scenario: str) -> str:
    # A path to a scenario file marks as the bundled scenario it is named after.
    return scenario.rsplit("/", 1)[-1].removesuffix(".json")


def bars(scenario: str, plot: str) -> dict[tuple[str, str], tuple[float, str]]:
    return {(c, q): v for (p, c, q), v in BARS.get(_key(scenario), {}).items() if p == plot}


def lines(scenario: str, plot: str) -> list[tuple[float, str]]:
    return list(LINES.get(_key(scenario), {}).get(plot, []))


def vlines(scenario: str, plot: str) -> list[tuple[float, str]]:
    return list(VLINES.get(_key(scenario), {}).get(plot, []))
