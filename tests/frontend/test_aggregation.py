"""Aggregation maths: percentiles from bins, goodput under an SLA, BCR, fleet cost, windows."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

import pytest

from frontend.telemetry import histogram
from frontend.telemetry.aggregator import SLA, Aggregator, goodput_count, summarize
from frontend.telemetry.store import LocalStore

NOW = 1_800_000_000.0


def rec(ttft=1.0, **kw):
    base = {
        "model": "m",
        "pipeline": "p-md",
        "handoff_mode": "none",
        "status": "ok",
        "ttft_s": ttft,
        "tpot_s": 0.03,
        "e2e_s": ttft + 3,
        "created_at": NOW,
    }
    base.update(kw)
    return base


def fresh(sla: SLA | None = None) -> Aggregator:
    return Aggregator(LocalStore(), sla_for=lambda model: sla or SLA())


@pytest.mark.parametrize("q", [0.5, 0.9, 0.99])
def test_percentile_from_bins_is_within_the_bin_resolution(q):
    rng = random.Random(7)
    values = sorted(rng.lognormvariate(0.5, 1.0) for _ in range(5000))
    counts: dict[int, int] = {}
    for v in values:
        counts[histogram.bin_index(v)] = counts.get(histogram.bin_index(v), 0) + 1
    exact = values[max(0, int(q * len(values) + 0.999999) - 1)]
    assert abs(histogram.percentile(counts, q) / exact - 1) <= histogram.RESOLUTION + 1e-9


def test_window_percentiles_per_pipeline_and_overall():
    agg = fresh()
    agg.observe_many([rec(ttft=t / 100) for t in range(1, 101)], now=NOW)  # 0.01 .. 1.00 s
    agg.observe_many([rec(ttft=20.0, pipeline="p-rld-md")] * 10, now=NOW)
    p, span = agg.window("1m", now=NOW + 0.5)
    s = summarize(p, seconds=span, cost_per_hour=None)
    assert s["requests"] == 110
    for q, exact in (("p50", 0.50), ("p90", 0.90), ("p99", 0.99)):
        assert s["ttft"]["p-md"][q] == pytest.approx(exact, rel=histogram.RESOLUTION)
    assert s["ttft"]["p-rld-md"]["p50"] == pytest.approx(20.0, rel=histogram.RESOLUTION)
    assert s["ttft"]["all"]["count"] == 110
    assert s["ttft"]["p-md"]["mean"] == pytest.approx(0.505)


def test_goodput_counts_everything_when_the_sla_holds():
    agg = fresh()
    agg.observe_many([rec(ttft=2.0)] * 600, now=NOW)
    p, _ = agg.window("1m", now=NOW)
    s = summarize(p, seconds=60, cost_per_hour=None)
    assert s["goodput_rps"] == pytest.approx(10.0)
    assert s["sla_met"] == {"m": True}


def test_goodput_discounts_the_tail_beyond_the_sla():
    # 90 fast, 5 between the P90 and P99 bounds, 5 slower than the P99 bound.
    agg = fresh()
    records = [rec(ttft=1.0)] * 90 + [rec(ttft=12.0)] * 5 + [rec(ttft=30.0)] * 5
    agg.observe_many(records, now=NOW)
    p, _ = agg.window("1m", now=NOW)
    s = summarize(p, seconds=60, cost_per_hour=None)
    # 90 fast leave room for 10 tail requests (10% of 100); of them at most 1% of the counted
    # may miss the P99 bound: 5 mid + (90 + 5) / 99 slow.
    assert s["goodput_rps"] == pytest.approx((90 + 5 + 95 / 99) / 60)
    assert s["sla_met"] == {"m": False}


def test_goodput_uses_the_models_own_sla_and_skips_failed_requests():
    agg = fresh(SLA(p90_ttft_s=0.5, p99_ttft_s=0.8))
    agg.observe_many([rec(ttft=0.6)] * 10 + [rec(ttft=0.1, status="error")] * 10, now=NOW)
    p, _ = agg.window("1m", now=NOW)
    assert summarize(p, seconds=60, cost_per_hour=None)["goodput_rps"] == 0.0


def test_goodput_count_formula():
    assert goodput_count(90, 0, 0) == 90
    assert goodput_count(90, 20, 0) == pytest.approx(100)
    assert goodput_count(0, 5, 5) == 0


def test_bcr_is_goodput_over_cost_per_hour():
    agg = fresh()
    agg.observe_many([rec(ttft=1.0)] * 120, now=NOW)
    p, _ = agg.window("1m", now=NOW)
    s = summarize(p, seconds=60, cost_per_hour=40.0)
    assert s["bcr"] == pytest.approx(2.0 / 40.0)
    assert summarize(p, seconds=60, cost_per_hour=0.0)["bcr"] is None


def test_tokens_cache_hit_rate_and_wan_utilisation():
    agg = fresh()
    agg.observe_many(
        [
            rec(
                prompt_tokens=1000,
                cached_tokens=900,
                completion_tokens=100,
                tokens_by_rld=10,
                tokens_by_md=90,
                kv_bytes_wan=75_000_000,
                prefill_instance="1",
                main_instance="3",
            )
        ]
        * 4,
        now=NOW,
    )
    p, _ = agg.window("1m", now=NOW)
    s = summarize(
        p,
        seconds=60,
        cost_per_hour=None,
        link_of={("1", "3"): "dc-a->dc-b"},
        link_bandwidth_gbps={"dc-a->dc-b": 0.1},
    )
    assert s["cache_hit_rate"] == pytest.approx(0.9)
    assert s["rld_share"] == pytest.approx(0.1)
    assert s["tokens"]["md"] == 360
    wan = s["wan"]["dc-a->dc-b"]
    assert wan["bytes"] == 300_000_000
    assert wan["gbps"] == pytest.approx(0.04)
    assert wan["utilisation"] == pytest.approx(0.4)


def test_windows_slide_and_the_hour_comes_from_minutes():
    agg = fresh()
    agg.observe(rec(created_at=NOW - 120), now=NOW)
    agg.observe(rec(created_at=NOW - 30), now=NOW)
    agg.observe(rec(created_at=NOW - 2000), now=NOW)
    assert agg.window("1m", now=NOW)[0].requests.popitem()[1] == 1
    assert sum(agg.window("5m", now=NOW)[0].requests.values()) == 2
    assert sum(agg.window("1h", now=NOW)[0].requests.values()) == 3


def test_series_points_cover_a_trailing_ten_seconds():
    agg = fresh()
    agg.observe_many([rec(created_at=NOW - 5)] * 20, now=NOW)
    points = agg.series(now=NOW + 0.3, points=3)
    assert [t for t, _, _ in points] == [NOW - 3, NOW - 2, NOW - 1]
    assert sum(points[-1][1].requests.values()) == 20


def test_totals_keep_counting_past_the_windows():
    agg = fresh()
    agg.observe(rec(created_at=NOW - 3 * 86400), now=NOW)
    agg.observe(rec(), now=NOW)
    assert sum(agg.totals().requests.values()) == 2


def test_fleet_cost_is_running_instances_times_prices_in_force(fleet):
    from fleet.choices import ActualState
    from fleet.models import UnitPrice
    from frontend.telemetry.fleet import fleet_cost_per_hour

    for key in ("prefill", "relay"):
        fleet[key].actual_state = ActualState.RUNNING
        fleet[key].save()
    # main decode is still pending: not billed
    cost, currency, unpriced = fleet_cost_per_hour()
    assert (cost, currency, unpriced) == (pytest.approx((8 + 4) * 2.0), "USD", [])
    fleet["main"].actual_state = ActualState.RUNNING
    fleet["main"].save()
    assert fleet_cost_per_hour()[0] == pytest.approx(12 * 2.0 + 8 * 2.5)
    # a new price period for gpu-a from tomorrow does not apply today, but does tomorrow
    old = UnitPrice.objects.get(gpu_type__model="gpu-a")
    tomorrow = datetime.now(UTC) + timedelta(days=1)
    old.effective_to = tomorrow
    old.save()
    UnitPrice.objects.create(
        gpu_type=old.gpu_type,
        datacenter=old.datacenter,
        price_per_gpu_hour=3,
        effective_from=tomorrow,
    )
    assert fleet_cost_per_hour()[0] == pytest.approx(12 * 2.0 + 8 * 2.5)
    later = tomorrow + timedelta(hours=1)
    assert fleet_cost_per_hour(when=later)[0] == pytest.approx(12 * 3.0 + 8 * 2.5)


def test_served_model_sla_row_changes_goodput(db, aggregator):
    from frontend.models import ServedModelSLA
    from frontend.telemetry import observe_many

    ServedModelSLA.objects.create(model_name="strict", p90_ttft_s=0.5, p99_ttft_s=1.0)
    observe_many([rec(model="strict", ttft=0.7, created_at=None)] * 10)
    observe_many([rec(model="lenient", ttft=0.7, created_at=None)] * 10)
    import time

    s = summarize(aggregator.window("1m", now=time.time())[0], seconds=60, cost_per_hour=None)
    assert s["sla_met"] == {"strict": False, "lenient": True}
    assert s["goodput_rps"] == pytest.approx(10 / 60)


def test_rebuild_replays_stored_records(fleet, aggregator):
    from frontend.synthetic import synthetic_records_create
    from frontend.telemetry import rebuild

    synthetic_records_create(count=25, seed=1)
    assert rebuild() == 25
    assert sum(aggregator.totals().requests.values()) == 25


def test_records_written_elsewhere_are_tailed_once(fleet, aggregator, settings):
    # Tailing is the in-process mode's way to see other writers; with Redis they share state.
    settings.REDIS_URL = ""
    from frontend.synthetic import synthetic_records_create
    from frontend.telemetry import observe_many
    from frontend.telemetry.service import tail_new_records

    tail_new_records()  # sets the watermark
    observe_many(synthetic_records_create(count=5, seed=2))  # observed here
    synthetic_records_create(count=7, seed=3)  # another process wrote these
    assert tail_new_records() == 7
    assert sum(aggregator.totals().requests.values()) == 12
