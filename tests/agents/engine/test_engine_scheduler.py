"""Scheduler limits: queue back-pressure, KV exhaustion, preemption and prompt chunking."""

from __future__ import annotations

import random

import pytest

from agents.engine import Engine, EngineConfig, EngineFull, SamplingParams

GREEDY_24 = SamplingParams(max_tokens=24)


def _drain(engine: Engine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_work():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
    return tokens


@pytest.fixture
def prompts(tiny) -> list[list[int]]:
    texts = ("First prompt, long enough to fill two and a bit blocks.", "Another one! " * 4)
    return [tiny.tokenizer.encode(t)[:45] for t in texts]


def _solo(tiny, prompts) -> dict[str, list[int]]:
    return {
        f"r{i}": Engine(tiny, EngineConfig(num_blocks=64)).generate(p, GREEDY_24).output_ids
        for i, p in enumerate(prompts)
    }


def test_full_queue_raises_engine_full(tiny, prompts) -> None:
    engine = Engine(tiny, EngineConfig(num_blocks=64, max_queued=2))
    engine.add_request("a", prompts[0], GREEDY_24)
    engine.add_request("b", prompts[1], GREEDY_24)
    with pytest.raises(EngineFull, match="queue is full"):
        engine.add_request("c", prompts[0], GREEDY_24)
    assert engine.stats().queued == 2


def test_max_running_bounds_the_batch(tiny, prompts) -> None:
    engine = Engine(tiny, EngineConfig(num_blocks=64, max_running=1))
    engine.add_request("r0", prompts[0], GREEDY_24)
    engine.add_request("r1", prompts[1], GREEDY_24)
    engine.step()
    assert (engine.stats().running, engine.stats().queued) == (1, 1)
    assert _drain(engine) == {
        "r0": _solo(tiny, prompts)["r0"][1:],
        "r1": _solo(tiny, prompts)["r1"],
    }


def test_a_decode_slot_is_free_while_running_plus_waiting_is_below_max_running(
    tiny, prompts
) -> None:
    engine = Engine(tiny, EngineConfig(num_blocks=64, max_running=2))
    assert engine.has_decode_slot()
    engine.add_request("r0", prompts[0], GREEDY_24)
    assert engine.has_decode_slot()  # one waiting, one slot left
    engine.add_request("r1", prompts[1], GREEDY_24)
    assert not engine.has_decode_slot()
    engine.step()
    assert engine.stats().running == 2 and not engine.has_decode_slot()
    _drain(engine)
    assert engine.has_decode_slot()


def test_out_of_kv_blocks_queues_then_evicts_the_finished_prefix(tiny, prompts) -> None:
    # 5 blocks: r0 takes 3 for its prompt and grows to 5; r1 (needs 3) must wait for it.
    engine = Engine(tiny, EngineConfig(num_blocks=5))
    engine.add_request("r0", prompts[0], GREEDY_24)
    engine.add_request("r1", prompts[1], GREEDY_24)
    first = engine.step()
    assert [o.request_id for o in first] == ["r0"]
    assert (engine.stats().running, engine.stats().queued) == (1, 1)
    tokens = _drain(engine)
    tokens["r0"] = first[0].token_ids + tokens["r0"]
    assert tokens == _solo(tiny, prompts)
    assert engine.stats().preemptions == 0


def test_decode_growth_preempts_the_newest_request_and_both_finish(tiny, prompts) -> None:
    # 6 blocks: both prompts fit (3 + 3), but the next block for decoding does not.
    engine = Engine(tiny, EngineConfig(num_blocks=6))
    engine.add_request("r0", prompts[0], GREEDY_24)
    engine.add_request("r1", prompts[1], GREEDY_24)
    assert _drain(engine) == _solo(tiny, prompts)
    assert engine.stats().preemptions >= 1


def test_request_larger_than_the_pool_is_rejected(tiny, prompts) -> None:
    engine = Engine(tiny, EngineConfig(num_blocks=4))
    with pytest.raises(ValueError, match="needs up to 5 KV blocks; the pool has 4"):
        engine.add_request("big", prompts[0], GREEDY_24)


def test_prefill_raises_engine_full_when_held_requests_own_the_pool(tiny, prompts) -> None:
    engine = Engine(tiny, EngineConfig(num_blocks=5))
    engine.prefill("held", prompts[0], SamplingParams(max_tokens=1))
    with pytest.raises(EngineFull):
        engine.prefill("next", prompts[1], SamplingParams(max_tokens=1))
    assert set(engine.requests) == {"held"}
    engine.release("held")
    assert engine.prefill("next", prompts[1], SamplingParams(max_tokens=1)).cached_tokens == 0


def test_max_batch_tokens_chunks_a_long_prompt(tiny, prompts) -> None:
    engine = Engine(tiny, EngineConfig(num_blocks=64, max_batch_tokens=16))
    result = engine.generate(prompts[0], GREEDY_24)
    assert result.output_ids == _solo(tiny, prompts)["r0"]
    assert engine.stats().forwards == 3 + 23  # 45 prompt tokens in chunks of 16, then decode


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        (lambda: EngineConfig(block_size=0), "block_size"),
        (lambda: EngineConfig(dtype="int8"), "dtype"),
        (lambda: SamplingParams(max_tokens=0), "max_tokens"),
        (lambda: SamplingParams(top_p=0.0), "top_p"),
        (lambda: SamplingParams(temperature=-1.0), "temperature"),
    ],
)
def test_invalid_configs_raise_value_error(factory, message) -> None:
    with pytest.raises(ValueError, match=message):
        factory()


def test_mixed_workload_matches_solo_outputs_and_returns_every_block(tiny) -> None:
    rng = random.Random(0)
    shared = [rng.randrange(256) for _ in range(60)]
    work = [
        (f"r{i}", shared[: rng.randrange(0, 60)] + [rng.randrange(256) for _ in range(9)], n)
        for i, n in enumerate([3, 17, 9, 25, 1, 12])
    ]
    engine = Engine(tiny, EngineConfig(num_blocks=8, max_running=4, max_batch_tokens=40))
    tokens: dict[str, list[int]] = {}
    for rid, ids, n in work:
        engine.add_request(rid, ids, SamplingParams(max_tokens=n))
        for out in engine.step():  # arrivals interleave with decoding
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
    for rid, ids in _drain(engine).items():
        tokens.setdefault(rid, []).extend(ids)
    solo = Engine(tiny, EngineConfig(num_blocks=64))
    expected = {
        rid: solo.generate(ids, SamplingParams(max_tokens=n)).output_ids for rid, ids, n in work
    }
    assert tokens == expected
    stats, cache = engine.stats(), engine.cache.stats()
    assert stats.cache_hits > 0  # the shared prefix was reused under eviction pressure
    # Every block in use is a cached, unpinned block: nothing leaked.
    assert (stats.kv_blocks_used, cache.locked_blocks) == (cache.cached_blocks, 0)
