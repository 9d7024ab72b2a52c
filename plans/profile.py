"""The live workload profile: what the fleet is asked to serve, read from the request records.

The autopilot sizes the fleet for this profile instead of a scenario's made-up workload:

- **Rate:** requests that arrived in the last 1, 5 and 15 minutes (every record counts,
  whatever became of it: demand is demand; a record's arrival is its end less its e2e time,
  and requests still in flight count from the gateway's admissions), per minute over the
  window, and a forecast a few
  minutes ahead by Holt's linear smoothing of the per-minute counts (level + trend, never
  below zero). The rate the planner sizes for is the larger of the last minute's rate and the
  forecast, so a ramp is met before it peaks and a fall is not followed until it shows.
- **Hit rate on MD:** each served request's cached tokens over its prompt (the decode-side
  cache's hit the policy saw): mean, quantiles and the share at or above 95% (the skew).
- **Context and output lengths:** quantiles of prompt and completion tokens.
- **Singular traffic:** the share of requests routed ``rld-only``.
- **The WAN:** per request that moved KV over the WAN, its bytes over the decoder's wait for
  them (transfer plus import: a lower bound of the link's throughput); the median.

``workload_overrides`` turns a profile into the planner's workload fields (log-normal lengths
fitted to the median and P90, a skewed hit distribution fitted to the mean and the share of
high hits).
"""

from __future__ import annotations

import math
from datetime import datetime, timedelta
from typing import Any

from django.utils import timezone

from pdd.vocab import Pipeline
from routing.models import Admission, RequestRecord

# Holt's smoothing of the per-minute counts, and how far ahead the forecast looks (minutes).
ALPHA, BETA = 0.5, 0.3
HORIZON_MIN = 5
HIGH_HIT = 0.95
# At most this many served requests are read for the distributions (the newest).
SAMPLE = 20_000
Z90 = 1.2816  # the standard normal's 90th percentile


def quantiles(values: list[float], qs=(0.1, 0.5, 0.9, 0.99)) -> dict[str, float]:
    """``{"p10": ..., "p90": ...}`` of `values` (nearest rank); {} without values."""
    if not values:
        return {}
    values = sorted(values)
    out = {}
    for q in qs:
        i = min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))
        out[f"p{round(q * 100)}"] = float(values[i])
    return out


def holt_forecast(counts: list[float], horizon: int = HORIZON_MIN) -> float:
    """Holt's linear method over per-minute counts: level + horizon x trend, at least 0."""
    if not counts:
        return 0.0
    level, trend = counts[0], 0.0
    for x in counts[1:]:
        previous = level
        level = ALPHA * x + (1 - ALPHA) * (level + trend)
        trend = BETA * (level - previous) + (1 - BETA) * trend
    return max(0.0, level + horizon * trend)


def arrived_at(ended: datetime, e2e_s: float | None) -> datetime:
    """When a recorded request arrived: records are written when a request ends."""
    return ended - timedelta(seconds=e2e_s or 0.0)


def arrival_times(model: str | None, start: datetime, now: datetime) -> list[datetime]:
    """When each request of the window arrived: a record's arrival is its end less its e2e
    time (records are written when a request ends, so under overload the records lag the
    arrivals); requests still in flight are the gateway's admissions (written on arrival)."""
    records = RequestRecord.objects.filter(created_at__gte=start)
    admissions = Admission.objects.filter(admitted_at__gte=start, admitted_at__lt=now)
    if model:
        records = records.filter(model=model)
        admissions = admissions.filter(model=model)
    out = []
    for created, e2e in records.values_list("created_at", "e2e_s"):
        at = arrived_at(created, e2e)
        if start <= at < now:
            out.append(at)
    out.extend(admissions.values_list("admitted_at", flat=True))
    return out


def per_minute(times: list[datetime], start: datetime, now: datetime) -> list[int]:
    """Arrivals per minute counted back from `now` (oldest first, zeros included): the last
    entry is the minute that ends now, never a partial clock minute, so a steady rate gives
    level counts and the forecast no false fall."""
    minutes = max(1, int((now - start).total_seconds() // 60))
    counts = [0] * minutes
    for at in times:
        back = int((now - at).total_seconds() // 60)
        if 0 <= back < minutes:
            counts[minutes - 1 - back] += 1
    return counts


def workload_profile(
    window_s: int = 900, *, model: str | None = None, now: datetime | None = None
) -> dict[str, Any]:
    """The profile of the last `window_s` seconds of records (of one served model, or all)."""
    now = now or timezone.now()
    start = now - timedelta(seconds=window_s)
    records = RequestRecord.objects.all()
    if model:
        records = records.filter(model=model)
    in_window = records.filter(created_at__gte=start, created_at__lte=now)
    times = arrival_times(model, start, now)
    rates = {}
    for label, seconds in (("1m", 60), ("5m", 300), ("15m", 900)):
        seconds = min(seconds, window_s)
        since = now - timedelta(seconds=seconds)
        rates[label] = sum(1 for at in times if at >= since) / seconds
    minutes = per_minute(times, start, now)
    forecast = holt_forecast([float(n) for n in minutes]) / 60.0
    sizing_rps = max(rates["1m"], forecast)
    served = list(
        in_window.filter(status="ok", prompt_tokens__gt=0)
        .order_by("-created_at")
        .values_list(
            "prompt_tokens",
            "cached_tokens",
            "completion_tokens",
            "kv_bytes_wan",
            "kv_wait_s",
        )[:SAMPLE]
    )
    hits = [min(1.0, c / p) for p, c, *_ in served]
    wan = [b * 8 / w / 1e9 for *_, b, w in served if b and w and w > 0]  # Gbit/s, per request
    total = len(times)
    singular = in_window.filter(pipeline=Pipeline.RLD_ONLY).count()
    return {
        "window_s": window_s,
        "model": model or "",
        "at": now.isoformat(),
        "requests": total,
        "served": len(served),
        "rate_rps": rates,
        "per_minute": minutes,
        "forecast_rps": forecast,
        "forecast_horizon_min": HORIZON_MIN,
        "sizing_rps": sizing_rps,
        "hit_rate": {
            "mean": sum(hits) / len(hits) if hits else None,
            "high_share": sum(h >= HIGH_HIT for h in hits) / len(hits) if hits else None,
            **quantiles(hits),
        },
        "prompt_tokens": quantiles([float(p) for p, *_ in served]),
        "output_tokens": quantiles([float(r[2]) for r in served]),
        "singular_share": singular / total if total else None,
        "wan_gbps": {"requests": len(wan), **quantiles(wan, (0.5, 0.9))},
    }


def _lengths(quantiles: dict[str, float], cap: int) -> dict[str, Any] | None:
    """A log-normal LengthDist (planner.workload) with the observed median and P90."""
    median, p90 = quantiles.get("p50"), quantiles.get("p90")
    if not median or median < 1:
        return None
    sigma = math.log(p90 / median) / Z90 if p90 and p90 > median else 0.05
    return {
        "median": float(median),
        "sigma": max(0.05, min(sigma, 3.0)),
        "min": 1,
        "max": int(max(cap, quantiles.get("p99", median), median)),
        "mixture": [],
    }


def _hits(hit: dict[str, Any]) -> dict[str, Any] | None:
    """The planner's hit-rate distribution fitted to the observed mean and high-hit share:
    skewed when that is reachable (the low part's mean must lie in (0, 0.95)), else fixed."""
    from planner.workload import HitRateDist

    mean, high = hit.get("mean"), hit.get("high_share")
    if mean is None:
        return None
    if high is not None and 0 < high < 1:
        try:
            HitRateDist(kind="skewed", mean=mean, high_fraction=high, high_lo=HIGH_HIT)
        except ValueError:
            pass
        else:
            return {"kind": "skewed", "mean": mean, "high_fraction": high, "high_lo": HIGH_HIT}
    return {"kind": "fixed", "mean": mean}


def workload_overrides(profile: dict[str, Any]) -> dict[str, Any]:
    """The planner workload fields (planner.workload.WorkloadSpec) this profile sets; fields it
    has no data for (no request served yet) stay the scenario's."""
    out: dict[str, Any] = {}
    prompt = _lengths(profile.get("prompt_tokens") or {}, 131_072)
    if prompt is not None:
        out["input_tokens"] = prompt
        out["context"] = None  # lengths as observed, not a session model's growth
    output = _lengths(profile.get("output_tokens") or {}, 8_192)
    if output is not None:
        out["output_tokens"] = output
    hits = _hits(profile.get("hit_rate") or {})
    if hits is not None:
        out["hit_rate"] = hits
    return out
