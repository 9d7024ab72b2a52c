"""Figures of a live run from canned client results and request records: percentiles with
failures, goodput under the SLA, BCR, the records' sums, missing records, the goals."""

from __future__ import annotations

import math

import pytest

from bench.pdd import metrics

SLA = {"ttft_p90_s": 1.0, "ttft_p99_s": 1.5}


def result(i: int, ttft: float, *, completed: bool = True, rid: str | None = None) -> dict:
    return {
        "index": i,
        "sent_s": float(i),
        "ttft_s": ttft,
        "e2e_s": ttft + 0.5,
        "max_gap_s": 0.05,
        "tpot_s": 0.02,
        "completed": completed,
        "completion_tokens": 10 if completed else 0,
        "request_id": rid if rid is not None else f"r{i}",
    }


def record(rid: str, **kw) -> dict:
    base = {
        "request_id": rid,
        "pipeline": "p-md",
        "prompt_tokens": 1000,
        "cached_tokens": 900,
        "estimated_cached_tokens": 900,
        "completion_tokens": 10,
        "tokens_by_rld": 0,
        "tokens_by_md": 10,
        "kv_bytes_wan": 1000,
        "handoff_bytes": 0,
        "ttft_s": 0.5,
        "prefill_s": 0.1,
        "kv_wait_s": 0.3,
    }
    return base | kw


def canned() -> tuple[dict, list[dict]]:
    results = [result(i, 0.1 * (i + 1)) for i in range(9)] + [result(9, math.nan, completed=False)]
    records = [record(f"r{i}") for i in range(8)]  # r8 completed but left no record
    records[0] |= {
        "pipeline": "p-rld-md",
        "cached_tokens": 950,
        "estimated_cached_tokens": 950,
        "tokens_by_rld": 10,
        "tokens_by_md": 0,
        "handoff_bytes": 64,
    }
    records[1] |= {
        "pipeline": "p-rld-md",
        "cached_tokens": 100,
        "tokens_by_rld": 4,
        "tokens_by_md": 6,
        "estimated_cached_tokens": 100,
    }
    return {"results": results, "last_arrival_s": 10.0, "span_s": 12.0}, records


def test_percentiles_rank_a_failed_request_last() -> None:
    assert metrics.pct([1.0, 2.0, math.inf], 50) == 2.0
    assert math.isinf(metrics.pct([1.0, 2.0, math.inf], 99))
    assert math.isnan(metrics.pct([], 50))
    assert metrics.pct([math.nan, 3.0], 50) == 3.0


def test_goodput_counts_completed_requests_within_the_sla_per_second() -> None:
    run, _ = canned()
    # TTFTs 0.1 .. 0.9 s are within 1 s, the failed one is not: 9 good in 10 s.
    assert metrics.goodput(run["results"], 1.0, 10.0) == pytest.approx(0.9)
    assert metrics.goodput(run["results"], 0.45, 10.0) == pytest.approx(0.4)
    assert metrics.goodput(run["results"], 1.0, 0.0) == 0.0


def test_bcr_is_goodput_per_cost_per_hour() -> None:
    assert metrics.bcr(1.8, 36.0) == pytest.approx(0.05)
    assert metrics.bcr(1.0, 0.0) == 0.0


def test_summary_of_a_canned_run() -> None:
    run, records = canned()
    s = metrics.summarise(
        run,
        records,
        sla=SLA,
        cost_per_hour=36.0,
        link_bytes_per_s=1000.0,
        wire_wan_bytes=9000.0,
        duration_s=10.0,
    )
    assert (s["sent"], s["completed"], s["failed"]) == (10, 9, 1)
    assert s["missing_records"] == 1  # r8
    assert s["records"] == 8
    assert math.isinf(s["ttft_s"]["p99"])  # the failed request
    assert s["ttft_s"]["p50"] == pytest.approx(0.55)
    assert s["rld_share"] == pytest.approx(14 / 80)
    assert s["pipelines"] == {"p-rld-md": 2, "p-md": 6}
    assert s["wan_bytes"] == 8000 and s["wan_wire_bytes"] == 9000.0
    assert s["wan_utilisation"] == pytest.approx(8000 / (10.0 * 1000.0))
    assert s["handoff_bytes"] == 64
    assert s["relayed_cached"] == 1 and s["relayed_cached_known"] == 1
    assert s["relayed_cached_share"] == pytest.approx(1 / 8)
    assert s["goodput_rps"] == pytest.approx(0.9)
    assert s["bcr"] == pytest.approx(0.9 / 36.0)
    assert not s["sla_met"]  # P99 is inf
    assert s["record_means"]["kv_wait_s"] == pytest.approx(0.3)


def test_the_relayed_though_cached_count_needs_more_than_ninety_percent() -> None:
    recs = [
        record("a", pipeline="p-rld-md", cached_tokens=901, estimated_cached_tokens=901),
        record("b", pipeline="p-rld-md", cached_tokens=900),
        record("c", pipeline="p-md", cached_tokens=1000),
        record("d", pipeline="p-rld-md", cached_tokens=950, estimated_cached_tokens=0),
    ]
    assert metrics.relayed_though_cached(recs) == 2
    assert metrics.relayed_though_known(recs) == 1


def test_a_record_without_the_new_latency_fields_is_tolerated() -> None:
    run, records = canned()
    for r in records:
        for name in ("prefill_s", "kv_wait_s", "estimated_cached_tokens"):
            r.pop(name)
    s = metrics.summarise(run, records, sla=SLA, cost_per_hour=1.0, link_bytes_per_s=1.0)
    assert math.isnan(s["record_means"]["prefill_s"])
    assert s["relayed_cached_known"] == 0


def _summary(p90: float, rld: float = 0.0, relayed_cached: float = 0.0) -> dict:
    return {"ttft_s": {"p90": p90}, "rld_share": rld, "relayed_cached_share": relayed_cached}


def test_goals_per_rate() -> None:
    live = {
        "idc-pd": {"u50": _summary(1.0)},
        "cdc-pd": {"u50": _summary(4.0)},
        "pdd": {"u50": _summary(1.05, rld=0.2, relayed_cached=0.01)},
    }
    sim = {"pdd": {"u50": _summary(1.2)}, "cdc-pd": {"u50": _summary(4.2)}}
    rows = {(g["goal"], g["what"]): g for g in metrics.goals(live, sim)}
    assert rows[("pdd_vs_cdc_p90", "PDD / CDC-PD P90 TTFT")]["value"] == pytest.approx(1.05 / 4)
    assert rows[("pdd_vs_cdc_p90", "PDD / CDC-PD P90 TTFT")]["met"]
    assert rows[("pdd_vs_idc_p90", "PDD / IDC-PD P90 TTFT")]["met"]
    assert not rows[("rld_share", "PDD RLD token share")]["met"]
    sim_pdd = rows[("sim_error", "simulator vs live P90 TTFT, pdd")]
    assert sim_pdd["value"] == pytest.approx(0.15 / 1.05) and sim_pdd["met"]
    assert rows[("sim_error", "simulator vs live P90 TTFT, cdc-pd")]["met"]
    relayed = [g for g in rows.values() if g["goal"] == "relayed_cached"][0]
    assert relayed["met"]


def test_an_infinite_p90_misses_its_goal() -> None:
    live = {"cdc-pd": {"u90": _summary(math.inf)}, "pdd": {"u90": _summary(2.0)}}
    row = [g for g in metrics.goals(live) if g["goal"] == "pdd_vs_cdc_p90"][0]
    assert not row["met"]


def test_diagnostics_split_the_tail() -> None:
    run, records = canned()
    d = metrics.diagnostics(run["results"], records)
    assert d["relayed"] == 2 and d["relayed_rld_alone"] == 1
    assert d["tail"]["n"] >= 1
    assert d["all"]["n"] == 8


def test_series_bins_rld_share_by_send_time() -> None:
    run, records = canned()
    ser = metrics.series(run["results"], records, 10.0, bin_s=5.0)
    assert ser["t"] == [2.5, 7.5]
    assert ser["rld_share"][0] == pytest.approx(14 / 50)
    assert ser["rld_share"][1] == 0.0
