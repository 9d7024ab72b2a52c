"""Figures from a run: latency percentiles, token share by role, SLA, goodput, cost and BCR,
and, under a tariff, what the goodput earns per unit of hardware cost."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from mypy_extensions import mypyc_attr

from pdd.policy import Pipeline
from pdd.spec import check_positive, check_range
from pdd.vocab import HandoffMode
from planner.sim import PIPELINE_CODES, RunRecord


@mypyc_attr(native_class=False)  # checked fields (planner/native.py)
@dataclass(slots=True)
class Sla:
    """Goodput counts only while TTFT P90 and P99 stay under these bounds (PDD's SLA)."""

    ttft_p90_s: float = 10.0
    ttft_p99_s: float = 15.0

    def __post_init__(self) -> None:
        check_positive(self, "ttft_p90_s")
        check_positive(self, "ttft_p99_s")


@mypyc_attr(native_class=False)  # checked fields (planner/native.py)
@dataclass(slots=True)
class Tariff:
    """What a provider bills, per million tokens; cached input at a fraction of the input price.

    docs/pdd.md: "Providers bill cached input tokens at 10-25% of the uncached price". Prices are in
    any currency unit; figures derived from them (revenue per unit-hour of hardware) are in that
    unit per the fleet's price unit.
    """

    input_per_mtok: float = 1.0
    cached_input_fraction: float = 0.1
    output_per_mtok: float = 4.0

    def __post_init__(self) -> None:
        check_positive(self, "input_per_mtok")
        check_range(self, "cached_input_fraction", 0.0, 1.0)
        check_positive(self, "output_per_mtok")

    def billed(self, uncached_input: float, cached_input: float, output: float) -> float:
        """The bill for these token counts (one request's, or a mean request's)."""
        return (
            (uncached_input + self.cached_input_fraction * cached_input) * self.input_per_mtok
            + output * self.output_per_mtok
        ) / 1e6


def percentiles(values: np.ndarray, qs: tuple[int, ...] = (50, 90, 99)) -> dict[str, float]:
    """Percentiles keyed "p50".. ; NaN (never happened) entries are dropped, inf kept."""
    values = values[~np.isnan(values)]
    if not len(values):
        return {f"p{q}": float("nan") for q in qs} | {"mean": float("nan"), "n": 0}
    # inf (never served) sorts last; interpolating between two infs would give NaN, so rank on a
    # finite stand-in and map it back.
    finite_max = float(values[np.isfinite(values)].max()) if np.isfinite(values).any() else 0.0
    ranked = np.where(np.isinf(values), finite_max + 1.0, values)
    out = {}
    for q in qs:
        v = float(np.percentile(ranked, q))
        # Anything above the largest finite value leans on a never-served request: inf.
        out[f"p{q}"] = float("inf") if v > finite_max else v
    finite = values[np.isfinite(values)]
    out["mean"] = float(finite.mean()) if len(finite) else float("inf")
    out["n"] = int(len(values))
    return out


def summarise(
    rec: RunRecord,
    sla: Sla,
    warmup_s: float,
    cost_per_hour: float,
    tariff: Tariff | None = None,
) -> dict[str, Any]:
    """One run's figures, measured over requests arriving after ``warmup_s``.

    ``billed_tokens`` is the mean served request's uncached input, cached input and output;
    with a ``tariff``, ``revenue`` prices it and what the goodput earns per hour and per
    unit-hour of hardware cost (zero when the SLA is missed, as goodput is).
    """
    # The window and the offered rate follow the trace's drawn arrivals; a closed-loop turn sent
    # later than drawn (its previous response had not ended) stays in the window it was drawn in.
    drawn = rec.drawn_arrival_s
    window = drawn >= warmup_s
    served = rec.pipeline >= 0
    # A request still waiting when the run ends never got its first token: count it as inf so
    # it fails the SLA instead of silently vanishing.
    ttft = np.where(np.isnan(rec.ttft_s), np.inf, rec.ttft_s)[window]
    stopped = rec.stopped_at_s is not None
    if stopped:
        # Stopped once the SLA could not be met: a request without a first token has one no
        # earlier than the stop (>= 0 if it was not sent by then), so every TTFT figure is a
        # lower bound, and they still fail the SLA.
        waited = np.nan_to_num(np.maximum(rec.stopped_at_s - rec.arrival_s, 0.0), nan=0.0)
        ttft = np.where(np.isnan(rec.ttft_s), waited, rec.ttft_s)[window]
    ttft_pct = percentiles(ttft, (50, 90, 99))
    horizon = float(drawn[window][-1] - warmup_s) if window.any() else 0.0
    rld = int(rec.rld_tokens[window].sum())
    md = int(rec.md_tokens[window].sum())
    pipelines = {
        name: int(((rec.pipeline == code) & window).sum()) for name, code in PIPELINE_CODES.items()
    }
    relayed = pipelines[Pipeline.P_RLD_MD]
    drawn_rps = float(window.sum() / horizon) if horizon > 0 else 0.0
    # The offered rate is what actually arrived in the measured span. With closed-loop sessions
    # a turn waits for its previous response, so a fleet that answers slowly receives fewer
    # requests per second than drawn (its turns slip past the span); comparing fleets at the
    # same drawn rate would credit the slower one with load it never got.
    arrived = (rec.arrival_s >= warmup_s) & (rec.arrival_s <= warmup_s + horizon)
    rps = float(arrived.sum() / horizon) if horizon > 0 else 0.0
    sla_met = bool(ttft_pct["p90"] < sla.ttft_p90_s and ttft_pct["p99"] < sla.ttft_p99_s)
    if stopped and sla_met:  # pragma: no cover - the stop rule makes this impossible
        raise AssertionError("a run stopped for a missed SLA meets it")
    in_window_hits = rec.md_hit_tokens[window & served]
    inputs = rec.input_tokens[window & served]
    cached = rec.cached_tokens[window & served]
    outputs = rec.output_tokens[window & served]
    billed = {
        "uncached_input": float((inputs - cached).mean()) if len(inputs) else 0.0,
        "cached_input": float(cached.mean()) if len(inputs) else 0.0,
        "output": float(outputs.mean()) if len(inputs) else 0.0,
    }
    goodput = rps if sla_met else 0.0
    extra: dict[str, Any] = {}
    if tariff is not None:
        extra["revenue"] = revenue(tariff, billed, goodput, cost_per_hour)
    return (
        {
            "requests": int(window.sum()),
            "offered_rps": rps,
            "drawn_rps": drawn_rps,
            "ttft_s": ttft_pct,
            "ttft_quarters": ttft_quarters(ttft, drawn[window], warmup_s, horizon),
            "ttft_parts": ttft_parts(rec, window, ttft_pct["p90"]),
            "e2e_s": percentiles((rec.finish_s - rec.arrival_s)[window]),
            "wan_transfer_s": percentiles(rec.wan_s[window]),
            "wan_pool_wait_s": percentiles(rec.wan_wait_s[window]),
            "wan_link_utilisation": rec.link_utilisation,
            "wan_pool_utilisation": rec.pool_utilisation,
            "pipelines": pipelines,
            "handoff": {
                HandoffMode.ONE_SHOT.value: int(((rec.handoff == 1) & window).sum()),
                HandoffMode.CATCH_UP.value: int(((rec.handoff == 2) & window).sum()),
            },
            "tokens": {
                "relay_decode": rld,
                "main_decode": md,
                "relay_share": rld / (rld + md) if rld + md else 0.0,
                "relay_tokens_per_relayed_request": (
                    float(
                        rec.rld_tokens[
                            window & (rec.pipeline == PIPELINE_CODES[Pipeline.P_RLD_MD])
                        ].mean()
                    )
                    if relayed
                    else 0.0
                ),
            },
            "md_hit_rate": float(in_window_hits.sum() / inputs.sum()) if inputs.sum() else 0.0,
            "unfinished": int((np.isnan(rec.finish_s) & window).sum()),
            "sla": {"p90_s": sla.ttft_p90_s, "p99_s": sla.ttft_p99_s, "met": sla_met},
            "goodput_rps": goodput,
            "cost_per_hour": cost_per_hour,
            "bcr": goodput / cost_per_hour if cost_per_hour else 0.0,
            "billed_tokens": billed,
        }
        | ({"stopped_at_s": rec.stopped_at_s, "ttft_lower_bounds": True} if stopped else {})
        | extra
    )


TTFT_PARTS = ("prefill", "kv", "slot", "step")


def ttft_parts(rec: RunRecord, window: np.ndarray, p90: float) -> dict[str, dict[str, float]]:
    """Where the first tokens' time went, as means over the window's first tokens ("all") and
    over those at or above the TTFT P90 ("tail"), and the tail's share relayed.

    ``prefill``: arrival to P finishing the prompt (queue and compute). ``kv``: to the KV being
    usable on the decode instance that gave the first token (RDMA to RLD or in-DC decode; the
    WAN to MD with its connection wait and any wait for an earlier turn's KV in flight).
    ``slot``: to that instance admitting it (a decode slot and KV memory free). ``step``: the
    first decode step. The four add up to the TTFT.
    """
    got = window & ~np.isnan(rec.ttft_s) & ~np.isnan(rec.first_start_s)
    arrival = rec.arrival_s[got]
    parts = {
        "prefill": rec.prefill_done_s[got] - arrival,
        "kv": rec.first_kv_s[got] - rec.prefill_done_s[got],
        "slot": rec.first_start_s[got] - rec.first_kv_s[got],
        "step": rec.ttft_s[got] - (rec.first_start_s[got] - arrival),
    }
    tail = rec.ttft_s[got] >= p90 if np.isfinite(p90) else np.zeros(int(got.sum()), bool)
    relayed = rec.pipeline[got] == PIPELINE_CODES[Pipeline.P_RLD_MD]
    out: dict[str, dict[str, float]] = {}
    for name, sel in (("all", np.ones(int(got.sum()), bool)), ("tail", tail)):
        n = int(sel.sum())
        row = {k: float(v[sel].mean()) if n else float("nan") for k, v in parts.items()}
        row["relayed_share"] = float(relayed[sel].mean()) if n else float("nan")
        row["n"] = n
        out[name] = row
    return out


def ttft_quarters(
    ttft: np.ndarray, drawn_s: np.ndarray, warmup_s: float, horizon_s: float
) -> list[dict[str, float]]:
    """TTFT P50 / P90 in each quarter of the measured span (by drawn arrival): a steady run's
    quarters agree; a queue still filling shows as quarters that climb."""
    if horizon_s <= 0 or not len(ttft):
        return []
    edges = warmup_s + horizon_s * np.arange(5) / 4.0
    quarter = np.clip(np.searchsorted(edges, drawn_s, side="right") - 1, 0, 3)
    return [percentiles(ttft[quarter == q], (50, 90)) for q in range(4)]


def revenue(
    tariff: Tariff, billed: dict[str, float], goodput_rps: float, cost_per_hour: float
) -> dict[str, float]:
    """What ``goodput_rps`` requests/s of the mean ``billed`` request earn under ``tariff``."""
    per_request = tariff.billed(billed["uncached_input"], billed["cached_input"], billed["output"])
    per_hour = goodput_rps * 3600.0 * per_request
    return {
        "per_request": per_request,
        "per_hour": per_hour,
        "per_cost": per_hour / cost_per_hour if cost_per_hour else 0.0,
    }
