"""Specification of the capacity planner on a tiny search."""

from __future__ import annotations

import pytest

from planner.api import plan
from planner.scenario import case_configs, load_scenario


def tiny():
    data = load_scenario("tiny-plan")
    config = next(iter(case_configs(data).values()))
    return config, data["search_space"]


def test_plan_ranks_configs_by_bcr_under_the_sla() -> None:
    config, space = tiny()
    results = plan(config["fleet"], config["workload"], config["sla"], space, top=10)
    assert len(results) == 4  # 2 P counts x 1 RLD x 2 MD counts
    bcrs = [r.bcr for r in results]
    assert bcrs == sorted(bcrs, reverse=True)
    best = results[0]
    assert best.goodput_rps > 0 and best.summary["sla"]["met"]
    assert best.bcr == pytest.approx(best.goodput_rps / best.cost_per_hour)
    # Cost follows the counts and unit prices (GPU-A 1.0, GPU-B 1.25 per unit-hour).
    for r in results:
        expected = (
            r.counts["prefill@A:GPU-A"]
            + r.counts["relay_decode@A:GPU-A"]
            + 1.25 * r.counts["main_decode@B:GPU-B"]
        )
        assert r.cost_per_hour == pytest.approx(expected)


def test_plan_rejects_an_empty_search_space() -> None:
    config, _ = tiny()
    with pytest.raises(ValueError, match="pools"):
        plan(config["fleet"], config["workload"], config["sla"], {"pools": []})


def test_plan_under_a_tariff_says_what_each_result_earns() -> None:
    config, space = tiny()
    results = plan(
        config["fleet"], config["workload"], config["sla"], space, top=2, tariff=config["tariff"]
    )
    for r in results:
        revenue = r.summary["revenue"]
        assert revenue["per_cost"] == pytest.approx(
            r.goodput_rps * 3600 * revenue["per_request"] / r.cost_per_hour
        )
    with pytest.raises(ValueError, match="tariff.cached_input_fraction"):
        plan(config["fleet"], config["workload"], config["sla"], space,
             tariff={"cached_input_fraction": 2})  # fmt: skip
