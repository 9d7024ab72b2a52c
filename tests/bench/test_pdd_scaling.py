"""The benchmark's scaling rules: rates from the trace's own KV deltas, the SLA, fleet cost."""

from __future__ import annotations

import numpy as np
import pytest

from bench.pdd import scaling
from planner.workload import Trace, generate


def _trace(inputs, cached, arrivals=None) -> Trace:
    n = len(inputs)
    return Trace(
        np.array(arrivals if arrivals is not None else np.linspace(0, 1, n), float),
        np.array(inputs, np.int64),
        np.array(cached, np.int64),
        np.ones(n, np.int64),
        np.arange(n, dtype=np.int64),
    )


def test_a_delta_is_the_prompt_minus_what_md_holds_of_the_session() -> None:
    trace = _trace([1000, 1200, 300], [96, 1000, 300])
    assert scaling.delta_tokens(trace).tolist() == [904, 200, 0]


def test_utilisation_is_the_deltas_bytes_over_the_span_and_the_link() -> None:
    trace = _trace([1096, 96], [96, 96])  # 1,000 delta tokens in all
    link = {"bandwidth_gbps": 8 * 4096 * 1000 / 1e9}  # 4,096,000 B/s: 1,000 tokens per second
    assert scaling.wan_utilisation(trace, 2.0, link) == pytest.approx(0.5)


@pytest.mark.parametrize("target", [0.5, 0.9])
def test_the_rate_makes_its_own_trace_keep_the_link_at_the_target(target: float) -> None:
    plan = scaling.rate_for(target, 60.0)
    trace = generate(scaling.workload(rps=plan.rps, duration_s=60.0))
    assert plan.requests == len(trace)
    assert plan.trace_utilisation == pytest.approx(scaling.wan_utilisation(trace, 60.0))
    assert abs(plan.trace_utilisation - target) < 0.05
    # The same seed and target give the same rate: fixed before any run.
    assert scaling.rate_for(target, 60.0).rps == plan.rps


def test_higher_targets_get_higher_rates() -> None:
    rates = [p.rps for p in scaling.plan_rates(60.0)]
    assert rates == sorted(rates) and len(set(rates)) == 3


def test_a_target_outside_zero_to_one_is_refused() -> None:
    with pytest.raises(ValueError, match="target"):
        scaling.rate_for(1.2, 60.0)


def test_the_trace_is_agentic_skewed_and_short_output() -> None:
    trace = generate(scaling.workload(rps=3.0, duration_s=600.0))
    hit = trace.hit_rate
    assert (hit > 0.8).mean() > 0.6  # most turns reuse their session's context
    opening = trace.cached_tokens <= scaling.SHARED_PREFIX_TOKENS
    delta = scaling.delta_tokens(trace)
    assert delta[opening].sum() > 0.5 * delta.sum()  # the few low-hit ones carry most KV
    assert np.median(trace.output_tokens) <= 16
    assert trace.closed_loop


ENGINE = {
    "prefill": {"overhead_s": 0.01, "per_token_s": 1e-4, "per_pair_s": 1e-7},
    "decode": {"overhead_s": 0.005, "per_ctx_token_s": 4e-6},
}


def test_the_fitted_step_times() -> None:
    assert scaling.prefill_seconds(ENGINE, 1000, 0) == pytest.approx(0.01 + 0.1 + 0.05)
    assert scaling.prefill_seconds(ENGINE, 100, 1000) == pytest.approx(
        0.01 + 0.01 + 100 * 1050 * 1e-7
    )
    assert scaling.decode_step_seconds(ENGINE, 1000) == pytest.approx(0.009)


def test_the_sla_is_a_multiple_of_the_idle_in_dc_ttft_of_the_median_opening() -> None:
    sla = scaling.sla_from(ENGINE, 1096)
    basis = scaling.prefill_seconds(ENGINE, 1000, 96) + scaling.decode_step_seconds(ENGINE, 1096)
    assert sla.basis_s == pytest.approx(basis)
    assert sla.ttft_p90_s == pytest.approx(scaling.SLA_FACTOR_P90 * basis, abs=1e-3)
    assert sla.ttft_p99_s == pytest.approx(1.5 * sla.ttft_p90_s, abs=2e-3)
    assert sla.to_dict()["opening_tokens"] == 1096


def test_the_median_opening_ignores_continuing_turns() -> None:
    trace = _trace([1000, 1400, 2000, 2100], [96, 96, 1400, 2000])
    assert scaling.median_opening_tokens(trace) == 1200


def test_fleet_cost_is_gpus_times_their_price_per_gpu_hour() -> None:
    rows = [
        {"gpu_count": 8, "price_per_gpu_hour": 2.0},
        {"gpu_count": 1, "price_per_gpu_hour": 2.0},
        {"gpu_count": 8, "price_per_gpu_hour": "2.50"},
    ]
    assert scaling.fleet_cost_per_hour(rows) == pytest.approx(38.0)
    assert scaling.fleet_cost_per_hour([]) == 0.0
