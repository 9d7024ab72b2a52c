"""Bands, not points: how a figure moves with the rate and the fitted engine constants.

A planner figure at one offered rate can sit on a cliff: near a fleet's capacity a 1% higher
rate can add tens of percent to the TTFT tail (paper-ttft's PDD P90 TTFT is 7.42 s at 79.375
RPS and 12.0 s at 80 RPS). Every headline figure is therefore reported with

- its *rate band*: the figure at the rate x (1 - b), x 0.99, x 1.01 and x (1 + b) (b = 5% by
  default), and the low and high over the band. A different rate is the *same* requests
  arriving faster or slower (arrival times and turn gaps divided by the factor: common random
  numbers), so the band shows what the rate does to this sample. Drawing a new trace at each
  rate (what a rate scan over ``workload.rps`` does) changes the sample as well: the whole
  session population is redrawn, and on short runs that noise can exceed the rate's effect;
- where cheap, its *seed spread*: the figure on other seeds at the same rate (``seeds``), the
  sampling noise the rate band leaves out;
- where cheap, its *constants band*: the figure with each fitted engine constant
  (``prefill_efficiency``, ``decode_mem_efficiency``) scaled by 1 -+ c (c = 5% by default);
- a *cliff* flag, by this rule: the operating point is on a cliff when P90 or P99 TTFT (the
  two figures the SLA bounds) at 1% more (or less) rate differs from its value at the rate by
  more than ``CLIFF_PCT`` (10%) of it, i.e. the tail's elasticity to the rate exceeds 10; an
  infinite (never served) figure anywhere in the 1% neighbourhood counts as a cliff;
- ``sla_flips``: whether the SLA verdict differs anywhere in the rate band.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

CLIFF_PCT = 10.0
FITTED = ("prefill_efficiency", "decode_mem_efficiency")
FIGURES = ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "relay_share")
RULE = (
    f"cliff: P90 or P99 TTFT at 1% more or less rate differs from its value at the rate by "
    f"more than {CLIFF_PCT:g}% (or is infinite)"
)

Points = Callable[..., list[dict[str, Any]]]


def _rel(a: float, b: float) -> float:
    """|a - b| / b, infinite when either is infinite or NaN."""
    if not (math.isfinite(a) and math.isfinite(b)) or b <= 0:
        return 0.0 if a == b and math.isfinite(a) else math.inf
    return abs(a - b) / b


def band(
    points: Points,
    rps: float,
    band_pct: float = 5.0,
    constants_pct: float = 5.0,
    seeds: tuple[int, ...] = (),
) -> dict[str, Any]:
    """The band around the point at ``rps``.

    ``points([(rate, mods), ...], note)`` simulates each point, ``mods`` a tuple of (name,
    value): ``rate_factor``, ``seed`` or an engine constant's factor, and returns dicts with
    ``met`` and the ``FIGURES``.
    """
    jobs = band_points(rps, band_pct, constants_pct, seeds)
    results = points(jobs, f"band +-{band_pct:g}% rate, +-{constants_pct:g}% constants")
    return band_of(results, rps, band_pct, constants_pct, seeds)


def _factors(band_pct: float) -> list[float]:
    b = band_pct / 100.0
    return sorted({1.0, 0.99, 1.01} | ({1 - b, 1 + b} if b else set()))


def _constants(constants_pct: float) -> list[tuple[str, float]]:
    c = constants_pct / 100.0
    return [(name, s) for name in FITTED for s in (1 - c, 1 + c)] if c else []


def band_points(
    rps: float, band_pct: float, constants_pct: float, seeds: tuple[int, ...] = ()
) -> list[tuple[float, tuple[tuple[str, Any], ...]]]:
    """The (rate, modifications) points a band needs, in the order ``band_of`` reads them."""
    jobs: list[tuple[float, tuple[tuple[str, Any], ...]]] = [
        (rps, (("rate_factor", f),) if f != 1.0 else ()) for f in _factors(band_pct)
    ]
    jobs += [(rps, ((name, s),)) for name, s in _constants(constants_pct)]
    return jobs + [(rps, (("seed", seed),)) for seed in seeds]


def band_of(
    results: list[dict[str, Any]],
    rps: float,
    band_pct: float,
    constants_pct: float,
    seeds: tuple[int, ...] = (),
) -> dict[str, Any]:
    """The band from the figures at ``band_points(rps, band_pct, constants_pct, seeds)``."""
    b = band_pct / 100.0
    factors = _factors(band_pct)
    consts = _constants(constants_pct)
    by_rate = results[: len(factors)]
    rate_rows = [
        {"factor": f, "rps": rps * f, "met": r["met"], **{k: r.get(k) for k in FIGURES}}
        for f, r in zip(factors, by_rate, strict=True)
    ]
    at = rate_rows[factors.index(1.0)]
    near = [row for row in rate_rows if row["factor"] in (0.99, 1.01)]
    change = max(_rel(row["ttft_p90_s"], at["ttft_p90_s"]) for row in near) * 100
    change99 = max(_rel(row["ttft_p99_s"], at["ttft_p99_s"]) for row in near) * 100
    wide = [row for row in rate_rows if 1 - b - 1e-12 <= row["factor"] <= 1 + b + 1e-12]
    out: dict[str, Any] = {
        "rule": RULE,
        "rate_pct": band_pct,
        "rate_model": "the same requests arriving faster or slower (common random numbers)",
        "rate": rate_rows,
        "ttft_p90_s": _span(at["ttft_p90_s"], [row["ttft_p90_s"] for row in wide]),
        "ttft_p99_s": _span(at["ttft_p99_s"], [row["ttft_p99_s"] for row in wide]),
        "relay_share": _span(at["relay_share"], [row["relay_share"] for row in wide]),
        "p90_change_pct_per_1pct_rate": change,
        "p99_change_pct_per_1pct_rate": change99,
        "cliff": bool(max(change, change99) > CLIFF_PCT),
        "sla_flips": len({row["met"] for row in wide}) > 1,
    }
    rest = results[len(factors) :]
    if consts:
        rows = [
            {"constant": name, "factor": s, "met": r["met"], **{k: r.get(k) for k in FIGURES}}
            for (name, s), r in zip(consts, rest[: len(consts)], strict=True)
        ]
        out["constants_pct"] = constants_pct
        out["constants"] = rows
        vals = [at["ttft_p90_s"]] + [row["ttft_p90_s"] for row in rows]
        out["ttft_p90_s_constants"] = _span(at["ttft_p90_s"], vals)
        out["sla_flips_constants"] = len({at["met"]} | {row["met"] for row in rows}) > 1
    if seeds:
        rows = [
            {"seed": seed, "met": r["met"], **{k: r.get(k) for k in FIGURES}}
            for seed, r in zip(seeds, rest[len(consts) :], strict=True)
        ]
        out["seeds"] = rows
        out["ttft_p90_s_seeds"] = _span(
            at["ttft_p90_s"], [at["ttft_p90_s"]] + [row["ttft_p90_s"] for row in rows]
        )
    return out


def _span(at: float, values: list[float]) -> dict[str, float]:
    finite = [v for v in values if v is not None and not math.isnan(v)]
    return {"at": at, "lo": min(finite, default=math.nan), "hi": max(finite, default=math.nan)}


def describe(name: str, b: Mapping[str, Any]) -> str:
    """One line for a figure's band: 'P90 TTFT 7.4 s (6.9-12.0 s over +-5% rate) CLIFF'."""
    s = b["ttft_p90_s"]
    text = (
        f"{name}: P90 TTFT {s['at']:.3g} s ({s['lo']:.3g}-{s['hi']:.3g} s over "
        f"+-{b['rate_pct']:g}% rate"
    )
    if "ttft_p90_s_constants" in b:
        k = b["ttft_p90_s_constants"]
        text += f"; {k['lo']:.3g}-{k['hi']:.3g} s over +-{b['constants_pct']:g}% constants"
    p99 = b["ttft_p99_s"]
    text += (
        f"), P99 {p99['at']:.3g} s ({p99['lo']:.3g}-{p99['hi']:.3g} s); P90 / P99 move "
        f"{b['p90_change_pct_per_1pct_rate']:.3g}% / {b['p99_change_pct_per_1pct_rate']:.3g}% "
        "per 1% rate"
    )
    if "ttft_p90_s_seeds" in b:
        k = b["ttft_p90_s_seeds"]
        text += f"; P90 {k['lo']:.3g}-{k['hi']:.3g} s over {len(b['seeds']) + 1} seeds"
    if b["cliff"]:
        text += f"  ON A CLIFF (> {CLIFF_PCT:g}% per 1%)"
    if b["sla_flips"]:
        text += "  SLA verdict flips within the band"
    return text
