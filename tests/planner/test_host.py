"""Engines sharing a host's cores (``fleet.host``): processor sharing stretches each busy
task's work by max(1, busy tasks / cores); off by default, leaving every run as it was."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest

from pdd.hardware import EngineSpec, GpuType, ModelSpec
from pdd.policy import InstanceState
from planner.api import parse_case, run_fleet
from planner.events import EventLoop
from planner.fleet import fleet_from_dict
from planner.host import Host, HostedDecode, HostedPrefill, HostSpec, HostWork
from planner.instances import DecodeInstance, PrefillInstance
from planner.metrics import Sla
from planner.scenario import case_configs, load_scenario
from planner.workload import ContextGrowth, HitRateDist, LengthDist, WorkloadSpec, generate

GPU = GpuType("A", peak_tflops=1000, mem_gb=640, mem_bw_tbps=10, interconnect_gbps=400,
              unit_price=1)  # fmt: skip
MODEL = ModelSpec("m", active_params_b=10, attn_flops_per_token_ctx=1e6, kv_bytes_per_token=10_000,
                  decode_weight_gb=10)  # fmt: skip
ENGINE = EngineSpec(prefill_overhead_s=1.0, decode_overhead_s=0.01)


def _prefill(loop: EventLoop, name: str, host: Host | None = None) -> PrefillInstance:
    args = (InstanceState(name, "prefill"), GPU, MODEL, ENGINE, loop)
    return PrefillInstance(*args) if host is None else HostedPrefill(*args, host=host)


def _decode(loop: EventLoop, name: str, host: Host | None = None) -> DecodeInstance:
    args = (InstanceState(name, "main_decode"), GPU, MODEL, ENGINE, loop, 10**9)
    return DecodeInstance(*args) if host is None else HostedDecode(*args, host=host)


def _prefill_ends(cores: float | None, starts: dict[str, float]) -> dict[str, float]:
    loop = EventLoop()
    host = Host(HostSpec(cores=cores), loop) if cores is not None else None
    done: dict[str, float] = {}
    for name, at in starts.items():
        inst = _prefill(loop, name, host)
        loop.at(at, inst.submit, 0, 1, 0, lambda _req, n=name: done.__setitem__(n, loop.now))
    loop.run()
    return done


def test_two_busy_prefills_on_one_core_take_twice_as_long() -> None:
    pass_s = ENGINE.prefill_overhead_s + MODEL.prefill_flops(1, 0) / (
        GPU.peak_tflops * 1e12 * ENGINE.prefill_efficiency
    )
    alone = _prefill_ends(None, {"a": 0.0, "b": 0.0})
    assert alone == {"a": pytest.approx(pass_s), "b": pytest.approx(pass_s)}
    shared = _prefill_ends(1, {"a": 0.0, "b": 0.0})
    assert shared == {"a": pytest.approx(2 * pass_s), "b": pytest.approx(2 * pass_s)}
    # Two cores for two instances: nothing is stretched.
    assert _prefill_ends(2, {"a": 0.0, "b": 0.0}) == alone
    # b starts half-way through a's pass: a does half alone, the rest at half speed (1 pass_s),
    # then b's remaining half alone.
    late = _prefill_ends(1, {"a": 0.0, "b": pass_s / 2})
    assert late["a"] == pytest.approx(1.5 * pass_s)
    assert late["b"] == pytest.approx(2 * pass_s)


def test_two_busy_decodes_on_one_core_take_twice_as_long() -> None:
    def ends(cores: float | None) -> tuple[dict[str, float], float]:
        loop = EventLoop()
        host = Host(HostSpec(cores=cores), loop) if cores is not None else None
        done: dict[str, float] = {}
        step = 0.0
        for name in ("a", "b"):
            inst = _decode(loop, name, host)

            def end(inst: DecodeInstance = inst, name: str = name) -> None:
                done[name] = loop.now
                inst.release(100)

            def begin(tpot: float, job: float, inst: DecodeInstance = inst, end=end) -> None:
                inst.run(job, 50, end)

            inst.admit(100, begin)
            step = inst.step
        loop.run()
        return done, step

    alone, _ = ends(None)
    shared, stretched = ends(1)
    assert shared["a"] == pytest.approx(2 * alone["a"])
    assert shared["b"] == pytest.approx(2 * alone["b"])
    unshared_step = ENGINE.decode_overhead_s + (MODEL.decode_weight_bytes(1) + 100 * 10_000) / (
        GPU.mem_bw_tbps * 1e12 * ENGINE.decode_mem_efficiency
    )
    assert stretched == pytest.approx(2 * unshared_step)  # the step a first token waits for


def test_the_gateways_work_takes_its_share_and_the_host_counts_cpu() -> None:
    loop = EventLoop()
    host = Host(HostSpec(cores=1, request_cpu_s=0.5), loop)
    gateway = HostWork(host, "gateway")
    inst = _prefill(loop, "p", host)
    pass_s = inst.engine.prefill_overhead_s + MODEL.prefill_flops(1, 0) / (
        GPU.peak_tflops * 1e12 * ENGINE.prefill_efficiency
    )
    done: list[float] = []
    inst.submit(0, 1, 0, lambda _req: done.append(loop.now))
    gateway.add(pass_s)  # as much gateway work as the pass: both at half speed
    loop.run()
    assert done == [pytest.approx(2 * pass_s)]
    cpu = host.cpu_seconds()
    assert cpu == {"gateway": pytest.approx(pass_s), "p": pytest.approx(pass_s)}
    assert host.busy == 0 and host.rate == 1.0


def _tiny_pdd() -> dict[str, Any]:
    """One P and one RLD in A, one MD in B over a thin link: the live testbed's PDD shape."""
    chip = {"peak_tflops": 1.0, "mem_gb": 0.3, "mem_bw_tbps": 9.3e-4, "interconnect_gbps": 8.0}
    return {
        "system": "pdd",
        "gpu_types": {"a": {**chip, "unit_price": 2.0}, "b": {**chip, "unit_price": 2.5}},
        "model": {
            "active_params_b": 0.075,
            "attn_flops_per_token_ctx": 1.4e5,
            "kv_bytes_per_token": 4096,
            "decode_weight_gb": 1e-6,
        },
        "pools": [
            {"role": "prefill", "gpu": "a", "count": 1, "datacenter": "A"},
            {"role": "relay_decode", "gpu": "a", "count": 1, "datacenter": "A"},
            {"role": "main_decode", "gpu": "b", "count": 1, "datacenter": "B"},
        ],
        "links": {"B": {"bandwidth_gbps": 0.06, "rtt_ms": 30.0, "pool_size": 16}},
        "engine": {
            "prefill_efficiency": 1.0,
            "prefill_overhead_s": 0.006,
            "prefill_batch_tokens": 2048,
            "decode_mem_efficiency": 1.0,
            "decode_overhead_s": 0.005,
            "max_decode_batch": 32,
        },
        "policy": {"wan_time_threshold_s": 0.25},
        "resident_weight_gb": 1e-3,
        "drc_capacity_gb": 0.26,
    }


def _trace():
    spec = WorkloadSpec(
        rps=2.0, duration_s=20.0, seed=1, mean_turns=4.0, turn_gap_s=3.0,
        output_tokens=LengthDist(median=12, sigma=0.6, min=2, max=48),
        hit_rate=HitRateDist(kind="session"),
        context=ContextGrowth(first_prompt=LengthDist(median=1400, sigma=0.35, min=400, max=2400),
                              append=LengthDist(median=80, sigma=0.8, min=8, max=400),
                              shared_prefix_tokens=96, max_context_tokens=3200),
    )  # fmt: skip
    return generate(spec)


def _record_arrays(record) -> list[np.ndarray]:
    return [record.ttft_s, record.finish_s, record.wan_s, record.pipeline, record.rld_tokens]


def test_the_default_and_an_ample_host_leave_the_run_unchanged() -> None:
    sla = Sla(1.5, 2.3)
    trace = _trace()
    base, rec = run_fleet(fleet_from_dict(_tiny_pdd()), trace, sla, 0.0)
    assert "host" not in base
    ample, rec_ample = run_fleet(
        fleet_from_dict({**_tiny_pdd(), "host": {"cores": 64}}), trace, sla, 0.0
    )
    for a, b in zip(_record_arrays(rec), _record_arrays(rec_ample), strict=True):
        np.testing.assert_array_equal(a, b)
    assert ample["host"]["cores"] == 64
    assert set(ample["host"]["cpu_s"]) == {"prefill-A-a-0", "relay_decode-A-a-0",
                                           "main_decode-B-b-0"}  # fmt: skip
    # One core for three engines and the gateway: every first token comes later or as soon.
    tight, rec_tight = run_fleet(
        fleet_from_dict({**_tiny_pdd(), "host": {"cores": 1, "request_cpu_s": 0.02}}),
        trace,
        sla,
        0.0,
    )
    assert tight["ttft_s"]["p90"] > base["ttft_s"]["p90"]
    assert tight["host"]["cpu_s"]["gateway"] == pytest.approx(
        0.02 * int(np.count_nonzero(~np.isnan(rec_tight.arrival_s)))
    )


BAD = [
    ({"cores": 0}, "fleet.host.cores: must be a positive number, got 0"),
    ({"cores": -2}, "fleet.host.cores: must be a positive number, got -2"),
    ({"cores": "2"}, "fleet.host.cores: must be a positive number, got '2'"),
    ({"cores": True}, "fleet.host.cores: must be a positive number, got True"),
    ({"cores": 2, "request_cpu_s": -0.01}, "fleet.host.request_cpu_s: must be a number in"),
    ({"cores": 2, "threads": 1}, "fleet.host.threads: unknown field"),
    ({}, "fleet.host: .*cores"),
    ("2", "fleet.host: must be an object"),
]


@pytest.mark.parametrize(("host", "message"), BAD, ids=[repr(h) for h, _ in BAD])
def test_a_bad_host_is_refused_naming_the_field(host: Any, message: str) -> None:
    config = copy.deepcopy(case_configs(load_scenario("paper-ttft"))["pdd"])
    config["fleet"]["host"] = host
    with pytest.raises(ValueError, match=message):
        parse_case("pdd", config, "fleet")
