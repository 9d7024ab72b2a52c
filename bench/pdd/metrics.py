"""Figures of one live run, from the client's measurements (the ground truth for latency) and
the gateway's request records (pipelines, tokens by role, bytes); and the goals. Pure."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from pdd.vocab import Pipeline

GOALS = {
    "pdd_vs_cdc_p90": 0.5,  # PDD / CDC-PD P90 TTFT <=
    "pdd_vs_idc_p90": 1.1,  # PDD / IDC-PD P90 TTFT <=
    "rld_share": 0.10,  # RLD token share <=
    "sim_error": 0.15,  # |sim - live| / live P90 TTFT <=
    "relayed_cached": 0.02,  # share of requests relayed although MD held > 90% of the prompt
}
CACHED_ENOUGH = 0.9


def pct(values: Iterable[float], q: float) -> float:
    """Percentile q of the values; NaN dropped, inf kept (a failed request ranks last)."""
    arr = np.array([v for v in values if not (isinstance(v, float) and math.isnan(v))], float)
    if not len(arr):
        return float("nan")
    finite = arr[np.isfinite(arr)]
    top = float(finite.max()) if len(finite) else 0.0
    ranked = np.where(np.isinf(arr), top + 1.0, arr)
    v = float(np.percentile(ranked, q))
    return float("inf") if v > top else v


def mean(values: Iterable[float]) -> float:
    arr = [v for v in values if v is not None and math.isfinite(v)]
    return float(sum(arr) / len(arr)) if arr else float("nan")


def goodput(results: Sequence[Mapping], sla_s: float, span_s: float) -> float:
    """Requests per second that completed with TTFT within the SLA bound."""
    good = sum(1 for r in results if r["completed"] and r["ttft_s"] <= sla_s)
    return good / span_s if span_s > 0 else 0.0


def bcr(goodput_rps: float, cost_per_hour: float) -> float:
    """Benefit-cost ratio: goodput (req/s) per unit of fleet cost per hour."""
    return goodput_rps / cost_per_hour if cost_per_hour > 0 else 0.0


def relayed_though_cached(records: Iterable[Mapping]) -> int:
    """p-rld-md records whose MD already held more than 90% of the prompt."""
    return sum(
        1
        for r in records
        if r.get("pipeline") == Pipeline.P_RLD_MD
        and (r.get("cached_tokens") or 0) > CACHED_ENOUGH * (r.get("prompt_tokens") or 0)
    )


def relayed_though_known(records: Iterable[Mapping]) -> int:
    """Of those, the ones whose decision already estimated MD's hit above 90% (relayed for
    the WAN's or MD's load, not for a stale view of MD's cache)."""
    return sum(
        1
        for r in records
        if r.get("pipeline") == Pipeline.P_RLD_MD
        and (r.get("cached_tokens") or 0) > CACHED_ENOUGH * (r.get("prompt_tokens") or 0)
        and (r.get("estimated_cached_tokens") or 0) > CACHED_ENOUGH * (r.get("prompt_tokens") or 0)
    )


def summarise(
    run: Mapping[str, Any],
    records: Sequence[Mapping],
    *,
    sla: Mapping[str, float],
    cost_per_hour: float,
    link_bytes_per_s: float,
    wire_wan_bytes: float | None = None,
    duration_s: float | None = None,
) -> dict[str, Any]:
    """One (system, rate) run: client latency percentiles, the records' token and byte sums,
    goodput under the SLA, BCR, and the client/record agreement.

    WAN busy is on the rate rule's basis: the run's requests' KV payload bytes (records) over
    the trace's arrival span (``duration_s``) and the link's bandwidth."""
    results = run["results"]
    sent = [r for r in results if not math.isnan(r["sent_s"])]
    done = [r for r in sent if r["completed"]]
    failed = len(sent) - len(done)
    # A request that failed (or never ended) never gave its user a first token: inf.
    ttft = [r["ttft_s"] if r["completed"] else float("inf") for r in sent]
    span = float(run.get("last_arrival_s") or 0.0) or float(run.get("span_s") or 0.0)
    by_id = {r["request_id"]: r for r in records}
    ids = {r["request_id"] for r in done if r["request_id"]}
    mine = [by_id[i] for i in ids if i in by_id]
    missing = sum(1 for r in done if not r["request_id"] or r["request_id"] not in by_id)
    out_tokens = sum(int(r.get("completion_tokens") or 0) for r in mine)
    rld_tokens = sum(int(r.get("tokens_by_rld") or 0) for r in mine)
    wan = sum(int(r.get("kv_bytes_wan") or 0) for r in mine)
    handoff = sum(int(r.get("handoff_bytes") or 0) for r in mine)
    pipelines: dict[str, int] = {}
    for r in mine:
        key = r.get("pipeline") or "-"
        pipelines[key] = pipelines.get(key, 0) + 1
    relayed_cached = relayed_though_cached(mine)
    record_ttft = [r.get("ttft_s") for r in mine if r.get("ttft_s") is not None]
    field_means = {
        name: mean(float(r[name]) for r in mine if r.get(name) is not None)
        for name in ("prefill_s", "kv_wait_s", "max_gap_s")
    }
    early = sum(1 for r in mine if r.get("first_token_early"))
    gp = goodput(sent, sla["ttft_p90_s"], span)
    p90, p99 = pct(ttft, 90), pct(ttft, 99)
    cost = cost_per_hour
    wire = wire_wan_bytes
    window = float(duration_s or span)
    return {
        "requests": len(results),
        "sent": len(sent),
        "completed": len(done),
        "failed": failed,
        "span_s": span,
        "offered_rps": len(sent) / span if span > 0 else 0.0,
        "ttft_s": {"p50": pct(ttft, 50), "p90": p90, "p99": p99},
        "tpot_s": {
            "mean": mean(r["tpot_s"] for r in done),
            "p50": pct([r["tpot_s"] for r in done], 50),
        },
        "e2e_s": {
            "p50": pct([r["e2e_s"] for r in done], 50),
            "p90": pct([r["e2e_s"] for r in done], 90),
        },
        "max_gap_s": {"p99": pct([r["max_gap_s"] for r in done], 99)},
        "records": len(mine),
        "missing_records": missing,
        "record_ttft_s": {"p50": pct(record_ttft, 50), "p90": pct(record_ttft, 90)},
        "record_means": field_means,
        "first_token_early": early,
        "pipelines": pipelines,
        "output_tokens": out_tokens,
        "rld_tokens": rld_tokens,
        "rld_share": rld_tokens / out_tokens if out_tokens else 0.0,
        "wan_bytes": wan,
        "wan_wire_bytes": wire,
        "wan_utilisation": wan / (window * link_bytes_per_s)
        if window > 0 and link_bytes_per_s > 0
        else 0.0,
        "handoff_bytes": handoff,
        "relayed_cached": relayed_cached,
        "relayed_cached_share": relayed_cached / len(mine) if mine else 0.0,
        "relayed_cached_known": relayed_though_known(mine),
        "sla": dict(sla),
        "sla_met": bool(p90 <= sla["ttft_p90_s"] and p99 <= sla["ttft_p99_s"]),
        "goodput_rps": gp,
        "cost_per_hour": cost,
        "bcr": bcr(gp, cost),
    }


def goals(
    live: Mapping[str, Mapping[str, Mapping]],
    sim: Mapping[str, Mapping[str, Mapping]] | None = None,
) -> list[dict[str, Any]]:
    """Each goal per rate: the measured value, the bound, met or not.

    ``live[system][rate]`` and ``sim[system][rate]`` are summaries (``ttft_s.p90`` and, live,
    ``rld_share`` / ``relayed_cached_share``); rates are keyed the same in both.
    """
    rows: list[dict[str, Any]] = []
    pdd = live.get("pdd", {})

    def add(goal: str, rate: str, value: float, bound: float, what: str) -> None:
        ok = value <= bound if math.isfinite(value) else False
        rows.append(
            {
                "goal": goal,
                "rate": rate,
                "value": value,
                "bound": bound,
                "met": bool(ok),
                "what": what,
            }
        )

    for rate, s in pdd.items():
        p90 = s["ttft_s"]["p90"]
        if "cdc-pd" in live and rate in live["cdc-pd"]:
            add(
                "pdd_vs_cdc_p90",
                rate,
                _ratio(p90, live["cdc-pd"][rate]["ttft_s"]["p90"]),
                GOALS["pdd_vs_cdc_p90"],
                "PDD / CDC-PD P90 TTFT",
            )
        if "idc-pd" in live and rate in live["idc-pd"]:
            add(
                "pdd_vs_idc_p90",
                rate,
                _ratio(p90, live["idc-pd"][rate]["ttft_s"]["p90"]),
                GOALS["pdd_vs_idc_p90"],
                "PDD / IDC-PD P90 TTFT",
            )
        add("rld_share", rate, s["rld_share"], GOALS["rld_share"], "PDD RLD token share")
        add(
            "relayed_cached",
            rate,
            s["relayed_cached_share"],
            GOALS["relayed_cached"],
            "PDD requests relayed although MD held > 90% of the prompt",
        )
    for system, by_rate in (sim or {}).items():
        for rate, s in by_rate.items():
            ref = live.get(system, {}).get(rate)
            if ref is None:
                continue
            live_p90 = ref["ttft_s"]["p90"]
            err = abs(s["ttft_s"]["p90"] - live_p90) / live_p90 if live_p90 > 0 else math.inf
            add("sim_error", rate, err, GOALS["sim_error"], f"simulator vs live P90 TTFT, {system}")
    return rows


def _ratio(a: float, b: float) -> float:
    if not (math.isfinite(a) and math.isfinite(b)) or b <= 0:
        return float("inf")
    return a / b


def series(
    results: Sequence[Mapping], records: Sequence[Mapping], span_s: float, bin_s: float = 5.0
) -> dict[str, list[float]]:
    """RLD token share per time bin (requests binned by when they were sent)."""
    by_id = {r["request_id"]: r for r in records}
    nbins = max(1, int(math.ceil(span_s / bin_s)))
    rld = [0] * nbins
    out = [0] * nbins
    for r in results:
        rec = by_id.get(r.get("request_id"))
        if rec is None or math.isnan(r["sent_s"]):
            continue
        b = min(int(r["sent_s"] // bin_s), nbins - 1)
        rld[b] += int(rec.get("tokens_by_rld") or 0)
        out[b] += int(rec.get("completion_tokens") or 0)
    return {
        "t": [bin_s * (k + 0.5) for k in range(nbins)],
        "rld_share": [rld[k] / out[k] if out[k] else float("nan") for k in range(nbins)],
    }


def diagnostics(results: Sequence[Mapping], records: Sequence[Mapping]) -> dict[str, Any]:
    """Where the time and the tokens went, for the report's explanations: the TTFT tail's
    (requests at or above the run's P90) mean prefill and KV wait and its share of openings
    and of relayed requests; how many relayed requests RLD finished alone."""
    by_id = {r["request_id"]: r for r in records}
    done = [r for r in results if r["completed"] and r["request_id"] in by_id]
    if not done:
        return {}
    p90 = pct([r["ttft_s"] for r in done], 90)

    def part(rows: list[Mapping]) -> dict[str, float]:
        recs = [by_id[r["request_id"]] for r in rows]
        n = len(recs) or 1
        return {
            "n": len(recs),
            "ttft_s": mean(r["ttft_s"] for r in rows),
            "prefill_s": mean(
                float(x["prefill_s"]) for x in recs if x.get("prefill_s") is not None
            ),
            "kv_wait_s": mean(
                float(x["kv_wait_s"]) for x in recs if x.get("kv_wait_s") is not None
            ),
            "opening_share": sum(
                1
                for x in recs
                if (x.get("cached_tokens") or 0) < 0.5 * (x.get("prompt_tokens") or 1)
            )
            / n,
            "relayed_share": sum(1 for x in recs if x.get("pipeline") == Pipeline.P_RLD_MD) / n,
        }

    relayed = [by_id[r["request_id"]] for r in done]
    relayed = [x for x in relayed if x.get("pipeline") == Pipeline.P_RLD_MD]
    return {
        "all": part(done),
        "tail": part([r for r in done if r["ttft_s"] >= p90]),
        "relayed": len(relayed),
        "relayed_rld_alone": sum(1 for x in relayed if not x.get("tokens_by_md")),
        "mean_output_tokens": mean(float(r["completion_tokens"]) for r in done),
    }
