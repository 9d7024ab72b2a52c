"""Specification of the simulated engines: decode step time follows the batch; chunked prefill."""

from __future__ import annotations

import pytest

from pdd.hardware import EngineSpec, GpuType, ModelSpec, decode_step_time, prefill_efficiency
from pdd.policy import InstanceState
from planner.events import EventLoop
from planner.instances import DecodeInstance, PrefillInstance

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
    # The scenarios' constants reproduce docs/pdd.md's measured 2.1x decode of GPU-B over GPU-A.
    import json
    from pathlib import Path

    from pdd.hardware import EngineSpec, GpuType, ModelSpec, decode_step_time
    from pdd.spec import strip_comments

    common = strip_comments(
        json.loads((Path(__file__).parents[2] / "planner/scenarios/_common.json").read_text())
    )["fleet"]
    gpus = {k: GpuType(name=k, **v) for k, v in common["gpu_types"].items()}
    model, engine = ModelSpec(**common["model"]), EngineSpec(**common["engine"])
    for batch in (1, 10, 128):
        ctx = batch * 62_000
        ratio = decode_step_time(ctx, model, gpus["GPU-A"], engine, batch) / decode_step_time(
            ctx, model, gpus["GPU-B"], engine, batch
        )
        assert abs(ratio - 2.1) < 0.01


MOE = ModelSpec("moe", active_params_b=10, attn_flops_per_token_ctx=1e6,
                kv_bytes_per_token=10_000, decode_weight_gb=20, decode_expert_gb=380,
                routed_experts=256, experts_per_token=8)  # fmt: skip


def test_an_moe_decode_step_reads_only_the_experts_its_batch_picks() -> None:
    engine = EngineSpec(decode_overhead_s=0.0)
    # One token picks 8 of 256 experts; 128 tokens touch nearly all of them.
    assert MOE.expert_fraction_touched(1) == pytest.approx(8 / 256)
    assert MOE.expert_fraction_touched(128) == pytest.approx(1 - (1 - 8 / 256) ** 128)
    assert MOE.expert_fraction_touched(128) > 0.98
    assert MOE.decode_weight_bytes(1) == pytest.approx((20 + 380 * 8 / 256) * 1e9)
    # Same KV, more requests: a bigger batch reads more expert weights, so it steps slower,
    # while each step still serves more tokens (throughput grows with the batch).
    steps = [decode_step_time(0, MOE, GPU, engine, b) for b in (1, 10, 128)]
    assert steps[0] < steps[1] < steps[2]
    assert steps[2] == pytest.approx(
        (20 + 380 * MOE.expert_fraction_touched(128))
        * 1e9
        / (GPU.mem_bw_tbps * 1e12 * engine.decode_mem_efficiency)
    )
    assert 1 / steps[0] < 10 / steps[1] < 128 / steps[2]
    # A dense model reads all its weights whatever the batch.
    assert decode_step_time(0, MODEL, GPU, engine, 1) == decode_step_time(0, MODEL, GPU, engine, 64)


def test_decode_instance_steps_at_its_running_batch() -> None:
    loop = EventLoop()
    engine = EngineSpec(decode_overhead_s=0.0)
    inst = DecodeInstance(InstanceState("d", "main_decode"), GPU, MOE, engine, loop,
                          kv_capacity_tokens=10**9)  # fmt: skip
    inst.admit(1_000, lambda tpot, job: None)
    one = inst.step
    inst.admit(1_000, lambda tpot, job: None)
    assert one == pytest.approx(decode_step_time(1_000, MOE, GPU, engine, 1))
    assert inst.step == pytest.approx(decode_step_time(2_000, MOE, GPU, engine, 2))
    assert inst.step > one
    inst.release(1_000)
    assert inst.step == pytest.approx(one)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"decode_expert_gb": 100}, "set all three"),
        ({"routed_experts": 256, "experts_per_token": 8}, "set all three"),
        ({"decode_expert_gb": 100, "routed_experts": 8, "experts_per_token": 16}, "<= routed"),
        ({"decode_expert_gb": -1}, "decode_expert_gb: must be a number >= 0"),
    ],
)
def test_moe_fields_are_checked(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelSpec("m", active_params_b=10, attn_flops_per_token_ctx=1e6,
                  kv_bytes_per_token=10_000, decode_weight_gb=20, **fields)  # fmt: skip


def test_decode_overhead_may_be_zero_but_not_negative() -> None:
    import pytest

    from pdd.hardware import EngineSpec

    EngineSpec(decode_overhead_s=0.0)
    with pytest.raises(ValueError, match="decode_overhead_s"):
        EngineSpec(decode_overhead_s=-0.001)


def _finish_order(order: str, arrivals: list[tuple[float, str, int]]) -> list[str]:
    """Names in the order their prefill ends; arrivals are (time, name, new tokens)."""
    engine = EngineSpec(prefill_batch_tokens=1000, prefill_overhead_s=0.001, prefill_order=order)
    loop = EventLoop()
    inst = PrefillInstance(InstanceState("p", "prefill"), GPU, MODEL, engine, loop)
    names: dict[int, str] = {}
    done: list[str] = []
    for k, (at, name, n) in enumerate(arrivals):
        names[k] = name
        loop.at(at, inst.submit, k, n, 0, lambda req: done.append(names[req]))
    loop.run()
    assert inst.queued == 0 and inst.backlog_tokens == 0
    return done


def test_fifo_prefill_finishes_a_long_request_before_a_later_short_one() -> None:
    # "long" needs 5 passes; "short" arrives while its first chunk runs.
    arrivals = [(0.0, "long", 5000), (1e-6, "short", 200)]
    assert _finish_order("fifo", arrivals) == ["long", "short"]


def test_srpt_prefill_lets_a_short_request_overtake_a_long_one_between_chunks() -> None:
    arrivals = [(0.0, "long", 5000), (1e-6, "short", 200), (2e-6, "mid", 900)]
    assert _finish_order("srpt", arrivals) == ["short", "mid", "long"]


def test_srpt_prefill_chunks_a_long_request_from_its_start_and_counts_every_token() -> None:
    engine = EngineSpec(prefill_batch_tokens=1000, prefill_overhead_s=0.001, prefill_order="srpt")
    loop = EventLoop()
    inst = PrefillInstance(InstanceState("p", "prefill"), GPU, MODEL, engine, loop)
    inst.submit(0, 2500, 100, lambda req: None)
    inst.submit(1, 300, 0, lambda req: None)
    loop.run()
    # the long one's first chunk (it was alone), the 300 alone, then 1000 + 500 of the long one.
    assert inst.passes == 4 and inst.tokens == 2800


def test_an_unknown_prefill_order_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="prefill_order: must be one of fifo, srpt"):
        EngineSpec(prefill_order="lifo")


def test_md_instances_index_the_sessions_they_hold_or_are_sent() -> None:
    # The simulator's router reads this index instead of every MD's cache; it may hold MDs
    # that evicted a session since (the router still checks the cache), never miss one.
    loop = EventLoop()
    holders: dict = {}
    a = DecodeInstance(InstanceState("a", "main_decode"), GPU, MODEL, EngineSpec(), loop,
                       10**6, cache_capacity_tokens=100, holders=holders)  # fmt: skip
    b = DecodeInstance(InstanceState("b", "main_decode"), GPU, MODEL, EngineSpec(), loop,
                       10**6, cache_capacity_tokens=100, holders=holders)  # fmt: skip
    a.cache_put(1, 0, 60)
    b.expect(1, 3)
    a.cache_put(2, 0, 60)  # evicts session 1 from a's cache (capacity 100)
    assert set(holders[1]) == {"a", "b"} and holders[2] == {"a": a}
    assert a.cached_version(1) is None and b.incoming_version(1) == 3
    assert 3 not in holders
