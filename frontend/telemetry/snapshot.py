"""The dashboard's snapshot: headline windows, the latest chart point and the live fleet."""

from __future__ import annotations

import time
from typing import Any

from frontend.telemetry.aggregator import WINDOWS_S, Aggregator, Parsed, summarize
from frontend.telemetry.fleet import FleetState, fleet_state
from frontend.telemetry.service import ensure_rebuilt, get_aggregator, tail_new_records

SERIES_POINTS = 300  # five minutes of live chart at one point per second
DAY_POINTS = 24 * 60


def _summary(p: Parsed, seconds: float, fleet: FleetState, cost: float | None) -> dict[str, Any]:
    return summarize(
        p,
        seconds=seconds,
        cost_per_hour=cost,
        link_of=fleet.link_of(p.wan.keys()),
        link_bandwidth_gbps=fleet.link_bandwidth(),
    )


def overload_queue() -> dict[str, Any]:
    """The overload queue of this process's gateway (routing/gateway/overload.py): requests
    waiting for room now (at the gateway, and in a prefill engine's queue), and totals."""
    from routing.gateway.overload import overload

    stats = overload.stats
    return {
        "waiting": stats.waiting,
        "at_prefill": stats.at_prefill,
        "queued_total": stats.queued_total,
        "mean_wait_s": (
            stats.wait_seconds_total / stats.queued_total if stats.queued_total else None
        ),
        "timed_out_total": stats.timed_out_total + stats.prefill_timed_out_total,
        "refused_total": stats.refused_total,
    }


def chart_point(t: int, p: Parsed, seconds: float, fleet: FleetState) -> dict[str, Any]:
    """One chart point: compact figures for the overview's live charts."""
    cost = p.cost_micro / 1e6 if p.cost_micro is not None else fleet.cost_per_hour
    s = _summary(p, seconds, fleet, cost)
    return {
        "t": t,
        "rps": s["rps"],
        "goodput_rps": s["goodput_rps"],
        "bcr": s["bcr"],
        "ttft": {k: [v["p50"], v["p90"], v["p99"]] for k, v in s["ttft"].items()},
        "rld_share": s["rld_share"],
        "md_share": s["md_share"],
        "cache_hit_rate": s["cache_hit_rate"],
        "wan": {k: v["utilisation"] for k, v in s["wan"].items()},
    }


def build_snapshot(
    *, now: float | None = None, aggregator: Aggregator | None = None
) -> dict[str, Any]:
    """Everything an open dashboard needs each second; computed once per process per tick."""
    ensure_rebuilt()
    aggregator = aggregator or get_aggregator()
    tail_new_records()
    aggregator.store.flush()
    now = time.time() if now is None else now
    fleet = fleet_state()
    aggregator.record_cost(fleet.cost_per_hour, now=now)
    windows = {}
    for name in WINDOWS_S:
        p, span = aggregator.window(name, now=now)
        windows[name] = _summary(p, span, fleet, fleet.cost_per_hour)
    [(t, p, span)] = aggregator.series(now=now, points=1)
    return {
        "type": "snapshot",
        "t": now,
        "windows": windows,
        "point": chart_point(t, p, span, fleet),
        "queue": overload_queue(),
        "fleet": {
            "cost_per_hour": fleet.cost_per_hour,
            "currency": fleet.currency,
            "unpriced_instances": fleet.unpriced_instances,
            "instances": fleet.instances,
            "links": [
                {**link, **windows["1m"]["wan"].get(link["name"], {})} for link in fleet.links
            ],
        },
    }


def build_history(
    *, scale: str = "live", now: float | None = None, aggregator: Aggregator | None = None
) -> dict[str, Any]:
    """Chart points to fill a page on load: the last 5 minutes by the second (``live``) or the
    last day by the minute (``day``)."""
    ensure_rebuilt()
    aggregator = aggregator or get_aggregator()
    tail_new_records()
    aggregator.store.flush()
    now = time.time() if now is None else now
    fleet = fleet_state()
    if scale == "day":
        rows = aggregator.series(now=now, points=DAY_POINTS, step="m")
    else:
        rows = aggregator.series(now=now, points=SERIES_POINTS)
    return {
        "type": "history",
        "scale": scale,
        "points": [chart_point(t, p, span, fleet) for t, p, span in rows],
    }
