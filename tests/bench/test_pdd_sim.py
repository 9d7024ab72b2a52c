"""The simulator's fleets for the benchmark: the measured engine maps onto the planner's
formulas exactly, the link and prices are the testbed's."""

from __future__ import annotations

import pytest

from bench.pdd import scaling
from bench.pdd.sim import fleet_dict
from planner.fleet import fleet_from_dict
from planner.hardware import decode_step_time, prefill_batch_time

ENGINE = {
    "prefill": {"overhead_s": 0.006, "per_token_s": 1.6e-4, "per_pair_s": 9.5e-8},
    "decode": {"overhead_s": 0.004, "per_ctx_token_s": 3.8e-6},
}


@pytest.mark.parametrize("system", ["idc-pd", "cdc-pd", "pdd"])
def test_the_planner_steps_as_the_measured_engine(system: str) -> None:
    fleet = fleet_from_dict(fleet_dict(system, ENGINE))
    gpu = next(iter(fleet.gpu_types.values()))
    for new, cached in ((1000, 0), (100, 1500)):
        flops = fleet.model.prefill_flops(new, cached)
        assert prefill_batch_time(flops, gpu, fleet.engine, new) == pytest.approx(
            scaling.prefill_seconds(ENGINE, new, cached), rel=1e-6
        )
    for ctx in (200, 8000):
        assert decode_step_time(ctx, fleet.model, gpu, fleet.engine, 4) == pytest.approx(
            scaling.decode_step_seconds(ENGINE, ctx), rel=1e-3
        )


def test_the_fleets_link_prices_and_policies() -> None:
    cdc = fleet_from_dict(fleet_dict("cdc-pd", ENGINE))
    assert cdc.links["B"].bandwidth_gbps == scaling.WAN_LINK["bandwidth_gbps"]
    assert cdc.links["B"].pool_size == scaling.WAN_LINK["connection_pool_size"]
    assert cdc.cost_per_hour() == pytest.approx(8 * 2.0 + 8 * 2.5)
    assert cdc.policy.wan_time_threshold_s >= 1e6
    pdd = fleet_from_dict(fleet_dict("pdd", ENGINE))
    assert pdd.cost_per_hour() == pytest.approx(8 * 2.0 + 2.0 + 8 * 2.5)
    assert pdd.policy.wan_time_threshold_s == 0.25
    assert pdd.policy.kv_bytes_per_token == scaling.KV_BYTES_PER_TOKEN
    idc = fleet_from_dict(fleet_dict("idc-pd", ENGINE))
    assert not idc.links and {p.datacenter for p in idc.pools} == {"A"}
    assert idc.cost_per_hour() == pytest.approx(16 * 2.0)
