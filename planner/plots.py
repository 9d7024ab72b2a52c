"""PNG plots of a SimResult (matplotlib, headless); imported only when plotting."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from planner import published  # noqa: E402
from planner.api import SimResult  # noqa: E402

PUBLISHED_STYLE = {"color": "black", "linewidth": 2.0}


def _mark_bars(ax, scenario: str, plot: str, names: list[str], quantiles, width: float) -> None:
    """A black dash across each bar a published figure compares with, labelled with it."""
    first = True
    for (case, q), (value, label) in published.bars(scenario, plot).items():
        if case not in names or q not in quantiles:
            continue
        x = names.index(case) + quantiles.index(q) * width
        ax.hlines(value, x - width / 2, x + width / 2, label="published" if first else None,
                  **PUBLISHED_STYLE)  # fmt: skip
        ax.annotate(label, (x, value), xytext=(0, 3), textcoords="offset points",
                    ha="center", va="bottom", fontsize=6)  # fmt: skip
        first = False


def _mark_lines(ax, scenario: str, plot: str) -> None:
    for k, (value, label) in enumerate(published.lines(scenario, plot)):
        style = (":", "-.", "--")[k % 3]
        ax.axhline(value, color="black", linestyle=style, linewidth=1.0, label=label)


def _case_ticks(ax, positions, names) -> None:
    ax.set_xticks(positions, names)
    if len(names) > 4:
        ax.tick_params(axis="x", labelrotation=25, labelsize=7)
        for label in ax.get_xticklabels():
            label.set_horizontalalignment("right")


def _mark_vlines(ax, scenario: str, plot: str) -> None:
    for value, label in published.vlines(scenario, plot):
        ax.axvline(value, color="grey", linestyle=":", linewidth=1.0, label=label or None)


def plot_result(result: SimResult, out: Path) -> list[Path]:
    paths = []
    series_cases = {n: c for n, c in result.cases.items() if c.series.get("t")}
    if series_cases:
        fig, ax = plt.subplots(figsize=(7, 4))
        for name, case in series_cases.items():
            ax.plot(case.series["t"], case.series["rld_load"], label=f"{name} RLD load")
        ax.set_xlabel("time (s)")
        ax.set_ylabel("relay decode load (running+queued / batch slots)")
        ax.set_title(f"{result.scenario}: relay load over time")
        ax.legend()
        paths.append(_save(fig, out / "relay_load.png"))
    if result.kind == "fleet" and not result.sweep:
        fig, ax = plt.subplots(figsize=(7, 4))
        names = list(result.cases)
        quantiles = ("p50", "p90", "p99")
        for k, q in enumerate(quantiles):
            values = [result.cases[n].summary["ttft_s"][q] for n in names]
            ax.bar([i + k * 0.25 for i in range(len(names))], values, width=0.25, label=q)
        _mark_bars(ax, result.scenario, "ttft", names, quantiles, 0.25)
        _mark_lines(ax, result.scenario, "ttft")
        _case_ticks(ax, [i + 0.25 for i in range(len(names))], names)
        ax.set_ylabel("TTFT (s)")
        ax.set_title(f"{result.scenario}: TTFT percentiles")
        ax.legend(fontsize=7)
        paths.append(_save(fig, out / "ttft.png"))
        shares = {n: result.cases[n].summary.get("tokens", {}).get("relay_share") for n in names}
        if published.lines(result.scenario, "token_share") and all(
            v is not None for v in shares.values()
        ):
            fig, ax = plt.subplots(figsize=(7, 4))
            ax.bar(range(len(names)), [shares[n] for n in names], label="simulated RLD share")
            _mark_lines(ax, result.scenario, "token_share")
            _case_ticks(ax, list(range(len(names))), names)
            ax.set_ylabel("share of output tokens decoded on RLD")
            ax.set_title(f"{result.scenario}: RLD token share")
            ax.legend(fontsize=7)
            paths.append(_save(fig, out / "token_share.png"))
    if result.kind == "transfer":
        fig, ax = plt.subplots(figsize=(7, 4))
        names = list(result.cases)
        quantiles = ("p50", "p90", "p99")
        for k, q in enumerate(quantiles):
            values = [result.cases[n].summary["transfer_s"][q] for n in names]
            ax.bar([i + k * 0.25 for i in range(len(names))], values, width=0.25, label=q)
        _mark_bars(ax, result.scenario, "transfer", names, quantiles, 0.25)
        _mark_lines(ax, result.scenario, "transfer")
        _case_ticks(ax, [i + 0.25 for i in range(len(names))], names)
        ax.set_yscale("log")
        ax.set_ylabel("KV transfer time (s)")
        ax.set_title(f"{result.scenario}: WAN transfer time")
        ax.legend(fontsize=7)
        paths.append(_save(fig, out / "transfer.png"))
    if result.sweep:
        fig, ax = plt.subplots(figsize=(7, 4))
        xs = [row["value"] for row in result.sweep]
        names = [k for k in result.sweep[0] if k != "value"]
        for name in names:
            ax.plot(xs, [row[name].get("bcr", 0.0) for row in result.sweep], "o-", label=name)
        pair = names if len(names) == 2 else ["idc-pd", "pdd"]
        if len(pair) == 2 and set(pair) <= set(names):
            a, b = pair
            ratio = [
                row[b]["bcr"] / row[a]["bcr"] if row[a].get("bcr") else float("nan")
                for row in result.sweep
            ]
            ax2 = ax.twinx()
            ax2.plot(xs, ratio, "k--", label=f"{b} / {a}")
            _mark_lines(ax2, result.scenario, "bathtub_ratio")
            ax2.set_ylabel(f"BCR ratio {b} / {a}")
            ax2.legend(loc="upper center", fontsize=7)
        _mark_vlines(ax, result.scenario, "bathtub")
        ax.set_xlabel("mean prefix hit rate")
        ax.set_ylabel("BCR (goodput RPS per unit-hour)")
        ax.set_title(f"{result.scenario}: benefit over the hit-rate range")
        ax.legend(loc="upper left")
        paths.append(_save(fig, out / "bathtub.png"))
        if all("revenue" in row[name] for row in result.sweep for name in names):
            fig, ax = plt.subplots(figsize=(7, 4))
            for name in names:
                ys = [row[name]["revenue"]["per_cost"] for row in result.sweep]
                ax.plot(xs, ys, "o-", label=name)
            ax.set_xlabel("mean prefix hit rate")
            ax.set_ylabel("revenue per unit-hour of hardware")
            ax.set_title(f"{result.scenario}: what the goodput earns at the tariff")
            ax.legend()
            paths.append(_save(fig, out / "revenue.png"))
    return paths


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
