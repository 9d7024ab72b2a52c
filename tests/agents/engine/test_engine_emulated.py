"""The emulated engine: the real scheduler and radix cache over block accounting, modelled
step times on a fake clock (behaviour, never the wall clock), and tokens that are a function
of the context, so every pipeline's tokens equal `single`'s."""

from __future__ import annotations

import inspect

import pytest

from agents.engine import Engine, EngineConfig, EngineFull, SamplingParams
from agents.engine.emulated import (
    BlockPool,
    EmulatedEngine,
    Pacer,
    context_token,
)
from agents.engine.interface import EMULATED, TORCH, InferenceEngine
from agents.engine.kv_pool import OutOfBlocks
from pdd.hardware import GpuType, decode_step_time, forward_time, prefill_batch_time
from pdd.profiles import load_profile

PROFILE = load_profile("profile:paper-dsv4")
# The planner's two published chip types (planner/scenarios/_common.json).
GPU_A = GpuType("GPU-A", 7912, 640, 26.8, 3200, 1.0)
GPU_B = GpuType("GPU-B", 6409, 1128, 56.3, 3200, 1.25)


class FakeClock:
    """A monotonic clock that only the engine's sleeps move."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def emulated(gpu: GpuType = GPU_A, clock: FakeClock | None = None, **kw) -> EmulatedEngine:
    clock = clock or FakeClock()
    return EmulatedEngine(PROFILE, gpu, clock=clock, sleep=clock.sleep, **kw)


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(i * 7 + salt) % 256 for i in range(n)]


def drain(engine: EmulatedEngine, rid: str | None = None) -> list[int]:
    out: list[int] = []
    while engine.has_work():
        for o in engine.step():
            if rid is None or o.request_id == rid:
                out += o.token_ids
    return out


# -- the interface -------------------------------------------------------------------------


def test_both_engines_implement_the_engine_interface():
    names = [n for n, v in vars(InferenceEngine).items() if callable(v) and not n.startswith("_")]
    assert isinstance(emulated(), InferenceEngine)
    for name in names:
        assert callable(getattr(Engine, name)), name
        want = inspect.signature(getattr(InferenceEngine, name))
        assert inspect.signature(getattr(Engine, name)).parameters.keys() == want.parameters.keys()
    assert Engine.kind == TORCH and EmulatedEngine.kind == EMULATED


def test_an_emulated_engine_says_so_and_what_unit_it_models():
    d = emulated(GPU_B).describe()
    assert d["kind"] == "emulated" and d["profile"] == "paper-dsv4"
    assert d["gpu"]["name"] == "GPU-B" and d["gpu"]["mem_bw_tbps"] == 56.3
    assert d["kv_bytes_per_token"] == 4400


# -- the KV pool at the unit's real capacity -----------------------------------------------


def test_the_kv_pool_holds_what_the_units_memory_leaves_beside_the_weights():
    engine = emulated(GPU_B)
    capacity = int((1128 - 400) * 1e9 / 4400)
    assert engine.pool.num_blocks == capacity // 16
    assert emulated(GPU_A).pool.num_blocks == int((640 - 400) * 1e9 / 4400) // 16


def test_a_unit_without_room_for_kv_is_refused_with_a_reason():
    small = GpuType("tiny", 100, 300, 1, 100, 1)
    with pytest.raises(ValueError, match="leaves no room for KV"):
        emulated(small)


def test_block_pool_recycles_ids_and_refuses_double_free_and_overdraw():
    pool = BlockPool(4, 16, 10)
    a = pool.allocate(3)
    assert a == [0, 1, 2] and pool.num_free_blocks == 1
    with pytest.raises(OutOfBlocks):
        pool.allocate(2)
    pool.free([1])
    assert pool.allocate(2) == [1, 3]
    with pytest.raises(AssertionError, match="double free"):
        pool.free([5])


def test_scheduler_preempts_when_the_pool_is_full_and_every_request_still_finishes():
    # A unit with room for 3 blocks of KV: two 16-token prompts are admitted with a block
    # each, and both cannot grow to a second one.
    unit = GpuType("small", 1000, 400 + 3 * 16 * 4400 / 1e9, 10, 100, 1)
    engine = emulated(unit)
    assert engine.pool.num_blocks == 3
    engine.add_request("a", prompt(16), SamplingParams(max_tokens=20))
    engine.add_request("b", prompt(16, 1), SamplingParams(max_tokens=20))
    outs = drain(engine)
    assert len(outs) == 40 and engine.stats().preemptions >= 1


def test_a_request_larger_than_the_pool_is_refused():
    unit = GpuType("small", 1000, 400 + 3 * 16 * 4400 / 1e9, 10, 100, 1)
    with pytest.raises(ValueError, match="needs up to"):
        emulated(unit).add_request("a", prompt(60), SamplingParams(max_tokens=1))


def test_the_queue_refuses_beyond_max_queued():
    engine = emulated(config=EngineConfig(max_queued=1))
    engine.add_request("a", prompt(10))
    with pytest.raises(EngineFull):
        engine.add_request("b", prompt(10))


def test_the_radix_cache_serves_a_later_turns_prefix():
    engine = emulated()
    first = prompt(64)
    engine.generate(first, SamplingParams(max_tokens=4))
    result = engine.generate(first + [1, 2, 3], SamplingParams(max_tokens=4))
    assert result.cached_tokens == 64
    assert engine.stats().cached_blocks >= 4


def test_chunked_prefill_runs_at_most_the_profiles_batch_tokens_per_forward():
    engine = emulated()
    engine.generate(prompt(40_000), SamplingParams(max_tokens=2))
    extends = [s for s in engine.steps if s.kind == "extend"]
    assert [s.new_tokens for s in extends] == [16384, 16384, 40_000 - 32768]
    assert engine.config.max_running == PROFILE.engine.max_decode_batch


def test_continuous_batching_decodes_every_running_request_in_one_step():
    engine = emulated()
    for i in range(5):
        engine.add_request(f"r{i}", prompt(32, i), SamplingParams(max_tokens=8))
    drain(engine)
    assert max(s.batch for s in engine.steps if s.kind == "decode") == 5


def test_decodes_ride_along_a_long_extend_so_no_stream_waits_for_all_of_it():
    """A 40K-token prompt arriving while two requests decode: every forward of its prefill
    (three chunks) also gives each decoding request its next token, and their tokens are
    still the context's (``single``'s)."""
    engine = emulated()
    for i in range(2):
        engine.add_request(f"d{i}", prompt(64, i), SamplingParams(max_tokens=12))
    got: dict[str, list[int]] = {"d0": [], "d1": []}
    for _ in range(3):  # their prefill and first decode steps
        for o in engine.step():
            got[o.request_id] += o.token_ids
    before = {k: len(v) for k, v in got.items()}
    engine.add_request("long", prompt(40_000, 9), SamplingParams(max_tokens=2))
    for _ in range(3):  # the long prompt's three chunks
        for o in engine.step():
            if o.request_id in got:
                got[o.request_id] += o.token_ids
    mixed = list(engine.steps)[-3:]
    assert [s.kind for s in mixed] == ["extend"] * 3
    # The decodes come first in the token budget: each chunk is 2 positions shorter.
    assert [s.new_tokens for s in mixed] == [16384, 16384, 40_000 - 2 * 16382 + 2]
    assert all(s.batch == 3 for s in mixed)
    assert {k: len(v) - before[k] for k, v in got.items()} == {"d0": 3, "d1": 3}
    while engine.has_work():
        for o in engine.step():
            if o.request_id in got:
                got[o.request_id] += o.token_ids
    assert engine.describe()["mixed_batches"] is True
    for i in range(2):
        ref = emulated().generate(prompt(64, i), SamplingParams(max_tokens=12))
        assert got[f"d{i}"] == ref.output_ids


def test_a_command_hands_other_requests_tokens_out_forward_by_forward():
    """A prefill run as one command (three forwards of a 40K prompt) while a request decodes:
    with ``on_outputs`` set (the agent's worker sets it), the decoding request's token of each
    forward goes out then; without it, they wait for the next step()."""
    for hooked in (True, False):
        engine = emulated()
        engine.add_request("d", prompt(64), SamplingParams(max_tokens=20))
        for _ in range(2):
            engine.step()
        calls: list[list[int]] = []
        if hooked:
            engine.on_outputs = lambda outs, calls=calls: calls.append(
                [t for o in outs for t in o.token_ids]
            )
        engine.prefill("p", prompt(40_000, 3), SamplingParams(max_tokens=1))
        if hooked:
            assert [len(c) for c in calls] == [1, 1, 1]
            assert sum(len(o.token_ids) for o in engine.step() if o.request_id == "d") == 1
        else:
            assert calls == []
            # The three tokens made meanwhile, and this step's.
            assert sum(len(o.token_ids) for o in engine.step() if o.request_id == "d") == 4


def test_the_torch_engines_default_keeps_extends_alone():
    assert EngineConfig().mixed_batches is False


# -- tokens ----------------------------------------------------------------------------------


def test_greedy_tokens_are_a_function_of_the_context():
    a, b = emulated(GPU_A), emulated(GPU_B)
    p = prompt(100)
    out = a.generate(p, SamplingParams(max_tokens=12)).output_ids
    assert out == b.generate(p, SamplingParams(max_tokens=12)).output_ids
    assert out[0] == context_token(p) and out[1] == context_token(p + out[:1])
    assert all(32 <= t < 127 for t in out)
    assert out != a.generate(prompt(100, 5), SamplingParams(max_tokens=12)).output_ids


def test_no_eos_so_a_request_runs_to_max_tokens():
    result = emulated().generate(prompt(10), SamplingParams(max_tokens=300))
    assert len(result.output_ids) == 300 and result.finish_reason == "length"


def test_seeded_sampling_is_reproducible():
    sp = SamplingParams(max_tokens=10, temperature=1.0, seed=7)
    one = emulated().generate(prompt(50), sp).output_ids
    assert one == emulated().generate(prompt(50), sp).output_ids
    assert one != emulated().generate(prompt(50), SamplingParams(max_tokens=10)).output_ids


def _single(p: list[int], n: int) -> list[int]:
    return emulated().generate(p, SamplingParams(max_tokens=n)).output_ids


def test_p_md_gives_singles_tokens_with_a_cached_prefix_on_md():
    p, sp = prompt(300), SamplingParams(max_tokens=30)
    pre_engine, main = emulated(GPU_A, kv_scale=100), emulated(GPU_B, kv_scale=100)
    main.generate(p[:160], SamplingParams(max_tokens=1))  # an earlier turn: MD caches 160
    start = main.cached_prefix_len(p)
    assert start == 160
    pre = pre_engine.prefill("r", p, sp)
    delta = pre_engine.export_kv("r", start, len(p))
    pre_engine.release("r")
    assert len(delta) == 24 + (len(p) - start) * 44  # 4,400 B/token scaled by 100
    assert pre_engine.represented_bytes(delta) == (len(p) - start) * 4400
    main.import_prefix("r", p, start, delta)
    main.start_decode("r", p, pre.first_token, sp)
    assert [pre.first_token, *drain(main, "r")] == _single(p, 30)


@pytest.mark.parametrize("batches", [[7], [3, 4, 2]])
def test_p_rld_md_handoff_gives_singles_tokens(batches):
    p, n = prompt(200), 40
    sp = SamplingParams(max_tokens=n)
    pre_engine, relay, main = emulated(), emulated(), emulated(GPU_B)
    pre = pre_engine.prefill("r", p, sp)
    full = pre_engine.export_kv("r", 0, len(p))
    relay.import_prefix("r", p, 0, full)
    relay.start_decode("r", p, pre.first_token, sp)
    main.import_prefix("r", p, 0, full)
    main.start_decode("r", p, pre.first_token, sp, hold=True)
    got = [pre.first_token]
    want = sum(batches)
    while len(got) < 1 + want:
        for o in relay.step():
            got += o.token_ids
    relay.release("r")
    ids, i = got[1:], 0
    for j, k in enumerate(batches):
        final = j == len(batches) - 1
        out = main.extend("r", ids[i : i + k], resume=final)
        i += k
    got += out.token_ids + drain(main, "r")
    assert got == _single(p, n)
    # MD computed P's first token and the handed-over ids in one forward per batch.
    extends = [s.new_tokens for s in main.steps if s.kind == "extend"]
    assert extends == [batches[0] + 1, *batches[1:]]


def test_a_torch_payload_is_refused_by_an_emulated_engine():
    from agents.engine.kv_pool import kv_header

    with pytest.raises(ValueError, match="real tensors"):
        BlockPool(10, 16, 4).import_kv(kv_header(0, 2, 1, 4, 0, 16) + bytes(16 * 64), [0])


def test_a_payload_of_another_scale_is_refused_with_a_reason():
    sender, receiver = emulated(kv_scale=10), emulated(kv_scale=100)
    p = prompt(32)
    sender.prefill("r", p, SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="same profile and kv_scale"):
        receiver.import_prefix("r", p, 0, sender.export_kv("r", 0, 32))
    assert receiver.stats().kv_blocks_used == 0


# -- timing: the hardware model, on a fake clock -------------------------------------------


def test_each_forward_takes_the_hardware_models_time():
    clock = FakeClock()
    engine = emulated(GPU_A, clock)
    engine.generate(prompt(1000), SamplingParams(max_tokens=5))
    steps = list(engine.steps)
    m, e = PROFILE.model, PROFILE.engine
    flops = m.prefill_flops(1000, 0)
    assert steps[0].seconds == pytest.approx(
        max(
            prefill_batch_time(flops, GPU_A, e, 1000),
            decode_step_time(1000, m, GPU_A, e, batch=1000),
        )
    )
    assert steps[1].seconds == pytest.approx(decode_step_time(1001, m, GPU_A, e, batch=1))
    assert clock.now == pytest.approx(sum(s.seconds for s in steps))
    assert engine.describe()["modelled_busy_s"] == pytest.approx(clock.now, abs=1e-5)


def test_heterogeneity_the_decode_chip_decodes_faster_and_prefills_slower():
    def run(gpu: GpuType) -> tuple[float, float]:
        engine = emulated(gpu)
        engine.generate(prompt(16384), SamplingParams(max_tokens=50))
        pre = [s.seconds for s in engine.steps if s.kind == "extend"]
        dec = [s.seconds for s in engine.steps if s.kind == "decode"]
        return sum(pre), sum(dec) / len(dec)

    (pre_a, dec_a), (pre_b, dec_b) = run(GPU_A), run(GPU_B)
    overhead = PROFILE.engine.prefill_overhead_s
    # Prefill is compute-bound: B's 81% of A's compute (beyond the fixed per-pass time).
    assert (pre_a - overhead) / (pre_b - overhead) == pytest.approx(6409 / 7912, rel=1e-6)
    # Decode is memory-bound: B's 2.1x of A's bandwidth.
    assert dec_a / dec_b == pytest.approx(56.3 / 26.8, rel=1e-6)


def test_speedup_divides_wall_time_not_modelled_time():
    clock = FakeClock()
    engine = emulated(GPU_A, clock, speedup=10)
    engine.generate(prompt(500), SamplingParams(max_tokens=5))
    modelled = sum(s.seconds for s in engine.steps)
    assert clock.now == pytest.approx(modelled / 10)


def test_the_pacer_makes_up_late_wakeups_so_the_rate_stays_modelled():
    clock = FakeClock()
    late: list[float] = []

    def oversleep(seconds: float) -> None:  # every sleep wakes 50% late
        late.append(seconds)
        clock.sleep(seconds * 1.5)

    pacer = Pacer(1.0, clock, oversleep)
    for i in range(10):
        pacer.charge(0.1, continuous=i > 0)
    # Wall time stays within one step of the modelled 1.0 s, not 1.5 s.
    assert clock.now < 1.0 + 0.1


def test_the_pacer_does_not_count_idle_time_as_lateness():
    clock = FakeClock()
    pacer = Pacer(1.0, clock, clock.sleep)
    pacer.charge(0.1)
    clock.now += 0.2  # idle
    pacer.charge(0.1, continuous=False)
    assert clock.now == pytest.approx(0.4)


def test_forward_time_checks_its_arguments():
    with pytest.raises(ValueError, match="one entry per request"):
        forward_time([1, 1], [3], PROFILE.model, GPU_A, PROFILE.engine)


def test_warm_prefix_caches_a_prompt_at_no_modelled_cost():
    engine = emulated()
    bs = engine.cache.block_size
    prompt = list(range(3, 3 + bs * 5 + 7))  # 5 whole blocks
    assert engine.warm_prefix(prompt) == 5
    assert engine.pacer.charged_s == 0.0
    assert engine.cache.match_prefix(prompt).matched_tokens == 5 * bs
    assert engine.warm_prefix(prompt) == 0  # already there
    longer = prompt[: 5 * bs] + list(range(500, 500 + 2 * bs))
    assert engine.warm_prefix(longer) == 2  # only the new blocks


def test_the_pacer_counts_the_time_a_loaded_host_loses():
    from agents.engine.emulated import Pacer

    clock = FakeClock()
    pacer = Pacer(clock=clock, sleep=clock.sleep)
    pacer.charge(0.1, continuous=True)
    assert pacer.lost_s == 0.0
    clock.now += 1.0  # the host was busy elsewhere for a second mid-run
    pacer.charge(0.1, continuous=True)
    assert pacer.lost_s == pytest.approx(1.0 - Pacer.CATCH_UP_S)
