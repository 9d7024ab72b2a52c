"""Specification of the simulated engines: decode step time follows the batch; chunked prefill."""

from __future__ import annotations

import pytest

from planner.events import EventLoop
from planner.hardware import EngineSpec, GpuType, ModelSpec, decode_step_time, prefill_efficiency
from planner.instances import DecodeInstance, PrefillInstance
from routing.policy import InstanceState

GPU = GpuType("A", peak_tflops=1000, mem_gb=640, mem_bw_tbps=10, interconnect_gbps=400,
              unit_price=1)  # fmt: skip
MODEL = ModelSpec("m", active_params_b=10, attn_flops_per_token_ctx=1e6, kv_bytes_per_token=10_000,
                  decode_weight_gb=10)  # fmt: skip


def decode(loop: EventLoop) -> DecodeInstance:
    return DecodeInstance(InstanceState("d", "main_decode"), GPU, MODEL, EngineSpec(), loop,
                          kv_capacity_tokens=10**9)  # fmt: skip


def test_decode_step_time_changes_when_the_batch_changes() -> None:
    loop = EventLoop()
    inst = decode(loop)
    engine = EngineSpec()
    alone = decode_step_time(1_000, MODEL, GPU, engine)
    both = decode_step_time(1_000 + 5_000_000, MODEL, GPU, engine)
    finished: dict[str, float] = {}
    jobs: dict[str, float] = {}

    def start(name: str, ctx: int, tokens: int) -> None:
        def begin(tpot: float, job: float) -> None:
            jobs[name] = job
            inst.run(job, tokens, lambda: (finished.__setitem__(name, loop.now),
                                           inst.release(ctx)))  # fmt: skip

        inst.admit(ctx, begin)

    start("a", 1_000, 100)
    # A heavy request joins after 10 steps and leaves after 20 of its own steps.
    loop.at(10 * alone, start, "b", 5_000_000, 20)
    loop.run()
    # a: 10 steps alone, 20 steps with b (slower), then 70 steps alone again.
    assert finished["b"] == pytest.approx(10 * alone + 20 * both)
    assert finished["a"] == pytest.approx(80 * alone + 20 * both)
    assert both > 1.5 * alone


def test_a_small_tail_chunk_in_front_of_long_requests_runs_alone_and_slowly() -> None:
    engine = EngineSpec(
        prefill_batch_tokens=1000, prefill_half_tokens=500, prefill_overhead_s=0.001
    )
    assert prefill_efficiency(1000, engine) == pytest.approx(engine.prefill_efficiency)
    assert prefill_efficiency(100, engine) < 0.3 * engine.prefill_efficiency

    def passes(new_tokens: list[int]) -> int:
        loop = EventLoop()
        inst = PrefillInstance(InstanceState("p", "prefill"), GPU, MODEL, engine, loop)
        for k, n in enumerate(new_tokens):
            inst.submit(k, n, 0, lambda req: None)
        loop.run()
        return inst.passes

    # 2,100-token requests: 2 full chunks + a 100-token tail each; the next request (2,100)
    # does not fit beside the tail, so every tail is its own pass.
    assert passes([2_100] * 4) == 12
    # Short requests batch whole: the first starts at once, the nine queued behind it share one.
    assert passes([100] * 10) == 2


def test_decode_step_scales_with_bandwidth_when_there_is_no_fixed_overhead() -> None:
    # The scenarios' constants reproduce PDD.md's measured 2.1x decode of GPU-B over GPU-A.
    import json
    from pathlib import Path

    from planner.hardware import EngineSpec, GpuType, ModelSpec, decode_step_time
    from planner.spec import strip_comments

    common = strip_comments(
        json.loads((Path(__file__).parents[2] / "planner/scenarios/_common.json").read_text())
    )["fleet"]
    gpus = {k: GpuType(name=k, **v) for k, v in common["gpu_types"].items()}
    model, engine = ModelSpec(**common["model"]), EngineSpec(**common["engine"])
    for ctx in (0, 128 * 62_000):
        ratio = decode_step_time(ctx, model, gpus["GPU-A"], engine) / decode_step_time(
            ctx, model, gpus["GPU-B"], engine
        )
        assert abs(ratio - 2.1) < 0.01


def test_decode_overhead_may_be_zero_but_not_negative() -> None:
    import pytest

    from planner.hardware import EngineSpec

    EngineSpec(decode_overhead_s=0.0)
    with pytest.raises(ValueError, match="decode_overhead_s"):
        EngineSpec(decode_overhead_s=-0.001)
