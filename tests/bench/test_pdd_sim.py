"""The simulator's fleets for the benchmark: the measured engine maps onto the planner's
formulas exactly, the link and prices are the testbed's."""

from __future__ import annotations

import pytest

from bench.pdd import scaling
from bench.pdd.sim import fleet_dict
from pdd.hardware import decode_step_time, prefill_batch_time
from planner.fleet import fleet_from_dict

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


def test_a_measured_kv_fabric_replaces_the_assumed_one() -> None:
    from bench.pdd.sim import INTRA_DC_GBPS, INTRA_DC_LATENCY_MS

    assumed = fleet_from_dict(fleet_dict("idc-pd", ENGINE))
    assert assumed.fabric.latency_ms == INTRA_DC_LATENCY_MS
    assert {g.interconnect_gbps for g in assumed.gpu_types.values()} == {INTRA_DC_GBPS}
    measured = fleet_from_dict(
        fleet_dict("idc-pd", {**ENGINE, "fabric": {"latency_ms": 24.7, "gbps": 1.03}})
    )
    assert measured.fabric.latency_ms == 24.7
    assert {g.interconnect_gbps for g in measured.gpu_types.values()} == {1.03}


def test_the_fabric_fit_recovers_latency_and_bandwidth() -> None:
    from bench.pdd.calibrate import fit_fabric

    decode = ENGINE["decode"]
    latency_s, gbps = 0.025, 1.0

    def point(tokens: int) -> dict:
        nbytes = tokens * scaling.KV_BYTES_PER_TOKEN
        step = decode["overhead_s"] + decode["per_ctx_token_s"] * tokens
        return {
            "prompt_tokens": tokens,
            "kv_bytes": nbytes,
            "kv_wait_s": latency_s + nbytes * 8 / (gbps * 1e9) + step,
        }

    fit = fit_fabric([point(n) for n in (300, 1300, 2400)], decode)
    assert fit["latency_ms"] == pytest.approx(25.0, rel=1e-6)
    assert fit["gbps"] == pytest.approx(1.0, rel=1e-6)
    assert fit["max_error"] < 1e-6


def test_the_measured_handoff_is_charged_to_every_wan_transfer_when_asked() -> None:
    import json
    from pathlib import Path

    from bench.pdd.sim import simulate

    summary = json.loads(
        (Path(__file__).resolve().parents[2] / "bench/pdd/summary.json").read_text()
    )
    engine, sla = summary["engine"], summary["scaling"]["sla"]
    waits = []
    for wan_handoff in (False, True):
        fabric = {"latency_ms": 100.0, "gbps": 8.0, "wan_handoff": wan_handoff}
        m = simulate("cdc-pd", {**engine, "fabric": fabric}, 1.0, 60.0, sla, None)
        waits.append(m["means"]["kv_wait_s"])
    # Each transfer lands 0.1 s later (the decoders then batch a little differently).
    assert waits[1] - waits[0] == pytest.approx(0.1, rel=0.02)


def test_a_negative_wan_handoff_is_refused_naming_the_field() -> None:
    from planner.wan import WanLinkSpec

    with pytest.raises(ValueError, match="handoff_ms"):
        WanLinkSpec(handoff_ms=-1.0)
    assert WanLinkSpec().handoff_ms == 0.0


def test_the_policy_sees_what_the_live_gateway_sees_unless_told_otherwise() -> None:
    """By default the testbed's policy reads the WAN link's use from 2-s heartbeats and counts
    the KV on its way to MD; 0 / False give the instantaneous, landed-only rules."""
    from bench.harness.control_plane import HEARTBEAT_S

    live = fleet_from_dict(fleet_dict("pdd", ENGINE))
    assert live.links["B"].report_interval_s == HEARTBEAT_S == 2.0
    assert live.decision_counts_in_flight is True
    instant = fleet_from_dict(fleet_dict("pdd", ENGINE, reports_s=0.0, decision_in_flight=False))
    assert instant.links["B"].report_interval_s == 0.0
    assert instant.decision_counts_in_flight is False


def test_a_relays_handoff_measured_apart_prices_only_the_relay_path() -> None:
    import json
    from pathlib import Path

    from bench.pdd.sim import simulate

    summary = json.loads(
        (Path(__file__).resolve().parents[2] / "bench/pdd/summary.json").read_text()
    )
    engine, sla = summary["engine"], summary["scaling"]["sla"]
    plain = {"latency_ms": 20.0, "gbps": 2.0}
    slow_relay = {**plain, "relay": {"latency_ms": 200.0, "gbps": 0.2}}
    pdd, idc = [], []
    for fabric in (plain, slow_relay):
        e = {**engine, "fabric": fabric}
        pdd.append(simulate("pdd", e, 2.0, 60.0, sla, None)["means"]["kv_wait_s"])
        idc.append(simulate("idc-pd", e, 2.0, 60.0, sla, None)["ttft_s"])
    assert pdd[1] > pdd[0] + 0.1  # relayed requests wait for the slower handoff
    assert idc[0] == idc[1]  # IDC-PD's plain handoff is untouched


def test_fabric_relay_fields_are_checked() -> None:
    from planner.fleet import FabricSpec

    with pytest.raises(ValueError, match="relay_gbps"):
        FabricSpec(relay_gbps=-1.0)
    with pytest.raises(ValueError, match="relay_latency_ms"):
        FabricSpec(relay_latency_ms=5.0)
    assert FabricSpec(relay_gbps=1.0).relay_latency_ms is None


def test_measure_fabric_refuses_an_unknown_kind() -> None:
    from bench.pdd.calibrate import measure_fabric

    with pytest.raises(ValueError, match="kind"):
        measure_fabric(kind="wan")


def test_each_fabric_point_is_the_median_of_its_repeated_requests(monkeypatch) -> None:
    from bench.pdd import calibrate

    waits = iter([0.30, 0.05, 0.06, 0.10, 0.11, 0.90])
    seen = []

    def sample(kind, n, threads, seed):
        seen.append((kind, n, seed))
        return {"kv_bytes": n * 4096, "kv_wait_s": next(waits)}

    monkeypatch.setattr(calibrate, "_fabric_sample", sample)
    points = calibrate.measure_fabric((300, 2400), kind="plain", repeats=3)
    assert seen == [("plain", 300, 0), ("plain", 300, 1), ("plain", 300, 2),
                    ("plain", 2400, 0), ("plain", 2400, 1), ("plain", 2400, 2)]  # fmt: skip
    # One slow request no longer sets the point.
    assert [p["kv_wait_s"] for p in points] == [0.06, 0.11]
    assert points[0]["kv_wait_samples_s"] == [0.30, 0.05, 0.06]
    with pytest.raises(ValueError, match="repeats"):
        calibrate.measure_fabric(repeats=0)
