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
    # The goodput comes with its band: the drawn rates the search stopped between.
    lo, hi = best.to_dict()["goodput_bracket_rps"]
    assert lo <= hi and lo >= best.goodput_rps * 0.5
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


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"lo_rps": 0}, "search_space.lo_rps: must be a positive number"),
        ({"hi_rps": "lots"}, "search_space.hi_rps: must be a positive number"),
        ({"iters": 2.5}, "search_space.iters: must be an integer"),
        ({"warmup_s": -1}, "search_space.warmup_s: must be a number >= 0"),
        ({"top": 3}, "search_space.top: unknown field"),
        ({"pools": [{"role": "prefill", "gpu": "GPU-A", "datacenter": "A", "counts": [1.5]}]},
         "search_space.pools\\[0\\].counts\\[0\\]: must be an integer >= 0"),
        ({"pools": [{"role": "prefill", "gpu": "GPU-A", "datacenter": "A", "counts": [-1]}]},
         "search_space.pools\\[0\\].counts\\[0\\]: must be an integer >= 0"),
        ({"pools": [{"role": "prefil", "gpu": "GPU-A", "datacenter": "A", "counts": [1]}]},
         "search_space.pools\\[0\\].role: must be one of"),
        ({"pools": [{"role": "prefill", "gpu": "GPU-Z", "datacenter": "A", "counts": [1]}]},
         "search_space.pools\\[0\\].gpu: unknown GPU type 'GPU-Z'"),
        ({"pools": [{"role": "prefill", "gpu": "GPU-A", "datacenter": "A", "count": [1],
                     "counts": [1]}]}, "search_space.pools\\[0\\].count: unknown field"),
    ],
)  # fmt: skip
def test_plan_names_a_bad_search_space_field_before_searching(change, message) -> None:
    config, space = tiny()
    with pytest.raises(ValueError, match=message):
        plan(config["fleet"], config["workload"], config["sla"], {**space, **change})
