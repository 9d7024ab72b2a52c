"""PNG plots of a SimResult (matplotlib, headless); imported only when plotting."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from planner.api import SimResult  # noqa: E402


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
        for k, q in enumerate(("p50", "p90", "p99")):
            values = [result.cases[n].summary["ttft_s"][q] for n in names]
            ax.bar([i + k * 0.25 for i in range(len(names))], values, width=0.25, label=q)
        ax.set_xticks([i + 0.25 for i in range(len(names))], names)
        ax.set_ylabel("TTFT (s)")
        ax.set_title(f"{result.scenario}: TTFT percentiles")
        ax.legend()
        paths.append(_save(fig, out / "ttft.png"))
    if result.kind == "transfer":
        fig, ax = plt.subplots(figsize=(7, 4))
        names = list(result.cases)
        for k, q in enumerate(("p50", "p90", "p99")):
            values = [result.cases[n].summary["transfer_s"][q] for n in names]
            ax.bar([i + k * 0.25 for i in range(len(names))], values, width=0.25, label=q)
        ax.set_xticks([i + 0.25 for i in range(len(names))], names)
        ax.set_yscale("log")
        ax.set_ylabel("KV transfer time (s)")
        ax.set_title(f"{result.scenario}: WAN transfer time")
        ax.legend()
        paths.append(_save(fig, out / "transfer.png"))
    if result.sweep:
        fig, ax = plt.subplots(figsize=(7, 4))
        xs = [row["value"] for row in result.sweep]
        names = [k for k in result.sweep[0] if k != "value"]
        for name in names:
            ax.plot(xs, [row[name].get("bcr", 0.0) for row in result.sweep], "o-", label=name)
        if len(names) == 2:
            a, b = names
            ratio = [
                row[b]["bcr"] / row[a]["bcr"] if row[a].get("bcr") else float("nan")
                for row in result.sweep
            ]
            ax2 = ax.twinx()
            ax2.plot(xs, ratio, "k--", label=f"{b} / {a}")
            ax2.set_ylabel(f"BCR ratio {b} / {a}")
            ax2.legend(loc="upper center")
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
