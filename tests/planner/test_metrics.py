"""Percentiles over runs where some requests never got a first token (inf)."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

from planner.metrics import percentiles


def test_a_percentile_leaning_on_a_never_served_request_is_inf_without_warnings() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's inf - inf interpolation warning would raise
        out = percentiles(np.array([1.0, 2.0, np.inf]), (50, 60, 99))
    assert out["p50"] == 2.0
    assert math.isinf(out["p60"]) and math.isinf(out["p99"])
    assert out["mean"] == 1.5  # over finite values
    assert out["n"] == 3


def test_all_never_served_and_nothing_at_all() -> None:
    assert math.isinf(percentiles(np.array([np.inf, np.inf]))["p50"])
    empty = percentiles(np.array([np.nan]))
    assert math.isnan(empty["p90"]) and empty["n"] == 0


def test_finite_values_are_plain_numpy_percentiles() -> None:
    values = np.arange(1.0, 101.0)
    out = percentiles(values)
    assert out["p50"] == np.percentile(values, 50)
    assert out["p99"] == np.percentile(values, 99)


# --- tariff: what the goodput earns ----------------------------------------------------------


def test_cached_input_is_billed_at_its_fraction_of_the_input_price() -> None:
    from planner.metrics import Tariff

    tariff = Tariff(input_per_mtok=2.0, cached_input_fraction=0.25, output_per_mtok=8.0)
    # 10K uncached + 40K cached (at a quarter) + 1K output, per million tokens.
    assert tariff.billed(10_000, 40_000, 1_000) == pytest.approx(
        (10_000 + 10_000) * 2.0 / 1e6 + 1_000 * 8.0 / 1e6
    )
    assert Tariff(cached_input_fraction=0.0).billed(0, 64_000, 0) == 0.0


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("cached_input_fraction", 1.5),
        ("cached_input_fraction", -0.1),
        ("input_per_mtok", 0),
        ("output_per_mtok", "4"),
    ],
)
def test_a_bad_tariff_names_its_field(field, value) -> None:
    from pdd.spec import build
    from planner.metrics import Tariff

    with pytest.raises(ValueError, match=f"tariff.{field}"):
        build(Tariff, {field: value}, "tariff")


def test_a_run_prices_its_served_requests_and_earns_nothing_off_the_sla() -> None:
    from planner.api import goodput_search, run_case
    from planner.fleet import fleet_from_dict
    from planner.metrics import Sla, Tariff
    from planner.scenario import deep_merge
    from tests.planner.test_sim import small_config

    config = deep_merge(
        small_config("pdd", duration_s=90, rps=2),
        {"tariff": {"input_per_mtok": 1.0, "cached_input_fraction": 0.1, "output_per_mtok": 4.0}},
    )
    summary = run_case("t", config, "fleet").summary
    billed = summary["billed_tokens"]
    assert billed["cached_input"] > billed["uncached_input"] > 0  # agentic: mostly cached
    assert billed["output"] > 0
    per_request = (
        billed["uncached_input"] + 0.1 * billed["cached_input"] + 4 * billed["output"]
    ) / 1e6
    assert summary["revenue"]["per_request"] == pytest.approx(per_request)
    assert summary["sla"]["met"]
    assert summary["revenue"]["per_cost"] == pytest.approx(
        summary["goodput_rps"] * 3600 * per_request / summary["cost_per_hour"]
    )
    # Without a tariff there are token counts but no revenue.
    del config["tariff"]
    assert "revenue" not in run_case("t", config, "fleet").summary

    # Off the SLA (a tiny TTFT bound) the goodput, and so the revenue, is zero.
    fleet = fleet_from_dict(config["fleet"])
    tight = Sla(ttft_p90_s=1e-3, ttft_p99_s=1e-3)
    found = goodput_search(fleet, config, tight, 10.0, 2.0, 8.0, rel_tol=0.1, tariff=Tariff())
    assert found["goodput_rps"] == 0.0
    assert found["revenue"]["per_hour"] == 0.0 and found["revenue"]["per_request"] > 0


def test_quarters_split_the_measured_span_by_drawn_arrival() -> None:
    from planner.metrics import ttft_quarters

    drawn = np.arange(60.0, 160.0)  # 100 requests over a 99-s span after a 60-s warm-up
    ttft = drawn - 59.0  # a queue that keeps growing
    quarters = ttft_quarters(ttft, drawn, 60.0, 99.0)
    assert [q["n"] for q in quarters] == [25, 25, 25, 25]  # the last arrival lands in the last
    p50s = [q["p50"] for q in quarters]
    assert p50s == sorted(p50s) and p50s[-1] > 3 * p50s[0]
    assert quarters[0]["p90"] == pytest.approx(np.percentile(ttft[:25], 90))
    assert ttft_quarters(ttft[:0], drawn[:0], 60.0, 0.0) == []


def test_an_overloaded_run_shows_climbing_quarters_and_a_light_one_does_not() -> None:
    from planner.api import run_case
    from tests.planner.test_sim import small_config

    light = run_case("t", small_config("pdd", duration_s=300, rps=2), "fleet").summary
    heavy = run_case("t", small_config("pdd", duration_s=300, rps=40), "fleet").summary
    light_p50 = [q["p50"] for q in light["ttft_quarters"]]
    heavy_p50 = [q["p50"] for q in heavy["ttft_quarters"]]
    assert len(light_p50) == len(heavy_p50) == 4
    assert max(light_p50) < 3 * min(light_p50)
    assert heavy_p50[-1] > 3 * heavy_p50[0]
    assert sum(q["n"] for q in heavy["ttft_quarters"]) == heavy["requests"]


# --- where the first tokens' time went ---------------------------------------------------------


def test_ttft_parts_add_up_to_each_first_token_and_name_the_wan() -> None:
    from planner.api import make_trace
    from planner.fleet import fleet_from_dict
    from planner.metrics import TTFT_PARTS, ttft_parts
    from planner.sim import Simulator
    from tests.planner.test_sim import small_config

    runs = {}
    for system in ("idc-pd", "cdc-pd", "pdd"):
        cfg = small_config(system, duration_s=240, rps=6)
        record = Simulator(fleet_from_dict(cfg["fleet"])).run(make_trace(cfg))
        got = ~np.isnan(record.ttft_s)
        start = record.first_start_s[got] - record.arrival_s[got]
        # Per request: prefill <= KV usable <= admitted <= first token.
        assert np.all(record.prefill_done_s[got] >= record.arrival_s[got])
        assert np.all(record.first_kv_s[got] >= record.prefill_done_s[got] - 1e-9)
        assert np.all(record.first_start_s[got] >= record.first_kv_s[got] - 1e-9)
        assert np.all(record.ttft_s[got] >= start)
        window = record.drawn_arrival_s >= 30.0
        p90 = float(np.percentile(record.ttft_s[window & got], 90))
        parts = ttft_parts(record, window, p90)
        mean_ttft = float(np.mean(record.ttft_s[window & got]))
        assert sum(parts["all"][k] for k in TTFT_PARTS) == pytest.approx(mean_ttft)
        assert parts["tail"]["n"] == int((record.ttft_s[window & got] >= p90).sum()) > 0
        runs[system] = parts
    # In one datacenter the KV moves over RDMA in milliseconds; across cities it crosses the WAN.
    assert runs["idc-pd"]["all"]["kv"] < 0.05 < runs["cdc-pd"]["all"]["kv"]
    assert runs["cdc-pd"]["all"]["relayed_share"] == 0.0
    assert 0.0 < runs["pdd"]["all"]["relayed_share"] < 1.0
    # PDD's relay answers low-hit requests over RDMA: less of its tail waits on the WAN.
    assert runs["pdd"]["tail"]["kv"] < runs["cdc-pd"]["tail"]["kv"]


def test_ttft_parts_of_an_empty_window_are_nan() -> None:
    from planner.api import make_trace
    from planner.fleet import fleet_from_dict
    from planner.metrics import ttft_parts
    from planner.sim import Simulator
    from tests.planner.test_sim import small_config

    cfg = small_config("pdd", duration_s=30, rps=2)
    record = Simulator(fleet_from_dict(cfg["fleet"])).run(make_trace(cfg))
    parts = ttft_parts(record, np.zeros(len(record.ttft_s), bool), float("nan"))
    assert parts["all"]["n"] == parts["tail"]["n"] == 0
    assert math.isnan(parts["all"]["prefill"]) and math.isnan(parts["tail"]["relayed_share"])
