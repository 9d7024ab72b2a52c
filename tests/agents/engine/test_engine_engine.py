"""Engine behaviour the pipelines rely on: prefix reuse, KV shipping, handoff by extend."""

from __future__ import annotations

import pytest

from agents.engine import (
    Engine,
    EngineConfig,
    FinishReason,
    PrefixMissing,
    SamplingParams,
)

GREEDY_24 = SamplingParams(max_tokens=24)


def _drain(engine: Engine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_work():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
    return tokens


def test_generate_is_deterministic_and_runs_to_max_tokens(tiny, engine_config, prompt) -> None:
    first = Engine(tiny, engine_config).generate(prompt, GREEDY_24)
    second = Engine(tiny, engine_config).generate(prompt, GREEDY_24)
    assert first == second
    assert (len(first.output_ids), first.finish_reason, first.cached_tokens) == (24, "length", 0)


def test_batched_decode_gives_each_request_its_solo_tokens(tiny, engine_config) -> None:
    prompts = [tiny.tokenizer.encode(t) for t in ("a", "hello there", "x" * 40, "batch me")]
    solo = [Engine(tiny, engine_config).generate(p, GREEDY_24).output_ids for p in prompts]
    engine = Engine(tiny, engine_config)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, GREEDY_24)
    assert _drain(engine) == {f"r{i}": out for i, out in enumerate(solo)}
    assert engine.stats().forwards < 4 * 24  # decode steps were shared


def test_second_request_reuses_the_shared_prefix(tiny, engine_config, prompt) -> None:
    other = prompt[:32] + tiny.tokenizer.encode(" and something else entirely")
    cold = Engine(tiny, engine_config).generate(other, GREEDY_24)
    engine = Engine(tiny, engine_config)
    engine.generate(prompt, GREEDY_24)
    assert engine.cached_prefix_len(other) == 32
    warm = engine.generate(other, GREEDY_24)
    assert warm.cached_tokens == 32
    assert warm.output_ids == cold.output_ids
    stats = engine.stats()
    assert (stats.cache_lookups, stats.cache_hits, stats.cache_matched_tokens) == (2, 1, 32)


def test_finished_turn_is_cached_for_the_next_turn(tiny, engine_config, prompt) -> None:
    engine = Engine(tiny, engine_config)
    turn1 = engine.generate(prompt, GREEDY_24)
    turn2 = prompt + turn1.output_ids + tiny.tokenizer.encode("more")
    # 45 + 24 tokens; the last sampled token has no KV, so 68 positions -> 4 whole blocks.
    assert engine.cached_prefix_len(turn2) == 64


def _ship(tiny, config, prompt, receiver: Engine, start: int):
    """P prefills, exports [start, len) and releases; the receiver decodes the rest."""
    sender = Engine(tiny, config)
    first = sender.prefill("req", prompt, GREEDY_24)
    payload = sender.export_kv("req", start, len(prompt))
    sender.release("req")
    imported = receiver.import_prefix("req", prompt, start, payload)
    receiver.start_decode("req", prompt, first.first_token, GREEDY_24)
    return [first.first_token, *_drain(receiver)["req"]], imported


def test_shipped_kv_decodes_like_generate_on_an_empty_receiver(tiny, engine_config, prompt):
    expected = Engine(tiny, engine_config).generate(prompt, GREEDY_24).output_ids
    receiver = Engine(tiny, engine_config)
    tokens, imported = _ship(tiny, engine_config, prompt, receiver, start=0)
    assert tokens == expected
    # The received whole blocks joined the decode-side cache (DRC).
    assert (imported.local_tokens, imported.received_tokens, imported.new_cached_blocks) == (
        0,
        45,
        2,
    )
    assert receiver.cached_prefix_len(prompt) == 32


def test_shipped_delta_on_top_of_a_cached_prefix_decodes_like_generate(
    tiny, engine_config, prompt
) -> None:
    expected = Engine(tiny, engine_config).generate(prompt, GREEDY_24).output_ids
    receiver = Engine(tiny, engine_config)
    receiver.generate(prompt[:32] + [ord("?")] * 5, SamplingParams(max_tokens=1))
    assert receiver.cached_prefix_len(prompt) == 32
    tokens, imported = _ship(tiny, engine_config, prompt, receiver, start=32)
    assert tokens == expected
    # Only the 13-token tail was received; it is not a whole block, so the DRC gained nothing.
    assert (imported.local_tokens, imported.received_tokens, imported.new_cached_blocks) == (
        32,
        13,
        0,
    )
    assert len(imported.block_table) == 3


def test_import_without_the_local_prefix_raises_prefix_missing(tiny, engine_config, prompt):
    sender = Engine(tiny, engine_config)
    sender.prefill("req", prompt, GREEDY_24)
    payload = sender.export_kv("req", 16, len(prompt))
    receiver = Engine(tiny, engine_config)
    with pytest.raises(PrefixMissing, match="holds only 0 tokens"):
        receiver.import_prefix("req", prompt, 16, payload)
    assert receiver.stats().kv_blocks_used == 0


def test_import_can_recompute_a_missing_prefix_and_decodes_like_generate(
    tiny, engine_config, prompt
) -> None:
    expected = Engine(tiny, engine_config).generate(prompt, GREEDY_24).output_ids
    sender = Engine(tiny, engine_config)
    first = sender.prefill("req", prompt, GREEDY_24)
    payload = sender.export_kv("req", 32, len(prompt))
    # The receiver holds the first block only: blocks [16, 32) are recomputed from the ids.
    receiver = Engine(tiny, engine_config)
    receiver.generate(prompt[:16] + [ord("?")] * 3, SamplingParams(max_tokens=1))
    assert receiver.cached_prefix_len(prompt) == 16
    imported = receiver.import_prefix("req", prompt, 32, payload, recompute_missing=True)
    assert (imported.local_tokens, imported.received_tokens, imported.recomputed_tokens) == (
        32,
        13,
        16,
    )
    receiver.start_decode("req", prompt, first.first_token, GREEDY_24)
    assert [first.first_token, *_drain(receiver)["req"]] == expected
    # The recompute left no request behind, only its KV in the cache.
    assert not any(rid.endswith("#recompute") for rid in receiver.requests)
    assert receiver.cached_prefix_len(prompt) == 32


def test_prefill_reuses_its_own_prefix_cache(tiny, engine_config, prompt) -> None:
    engine = Engine(tiny, engine_config)
    engine.prefill("a", prompt, GREEDY_24)
    engine.release("a")
    second = engine.prefill("b", prompt, GREEDY_24)
    assert second.cached_tokens == 32
    assert len(second.block_table) == 3


def _handoff(tiny, config, prompt, rld_tokens: int, batches: list[int]) -> list[int]:
    """P -> RLD decodes `rld_tokens`; MD receives the KV, then the RLD tokens in `batches`."""
    sender = Engine(tiny, config)
    first = sender.prefill("req", prompt, GREEDY_24).first_token
    payload = sender.export_kv("req", 0, len(prompt))
    rld, md = Engine(tiny, config), Engine(tiny, config)
    for engine in (rld, md):
        engine.import_prefix("req", prompt, 0, payload)
    rld.start_decode("req", prompt, first, GREEDY_24)
    relayed = [first]
    while len(relayed) < rld_tokens:
        relayed += rld.step()[0].token_ids
    rld.release("req")
    md.start_decode("req", prompt, first, GREEDY_24, hold=True)
    sent = 1
    for size in batches[:-1]:  # catch-up: MD computes KV only and keeps waiting
        assert md.extend("req", relayed[sent : sent + size], resume=False) is None
        sent += size
    nxt = md.extend("req", relayed[sent:])
    return [*relayed, *nxt.token_ids, *_drain(md).get("req", [])]


def test_one_shot_handoff_by_extend_continues_like_generate(tiny, engine_config, prompt):
    expected = Engine(tiny, engine_config).generate(prompt, GREEDY_24).output_ids
    assert _handoff(tiny, engine_config, prompt, rld_tokens=10, batches=[9]) == expected


def test_catch_up_handoff_in_batches_continues_like_generate(tiny, engine_config, prompt):
    expected = Engine(tiny, engine_config).generate(prompt, GREEDY_24).output_ids
    assert _handoff(tiny, engine_config, prompt, rld_tokens=15, batches=[6, 5, 3]) == expected


def test_extend_recomputes_k_tokens_in_one_forward(tiny, engine_config, prompt) -> None:
    engine = Engine(tiny, engine_config)
    engine.start_decode("req", prompt, 65, GREEDY_24, hold=True)
    before = engine.stats().forwards
    engine.extend("req", [66] * 16)
    assert engine.stats().forwards == before + 1
    assert engine.stats().tokens_computed == len(prompt) + 17


def test_seeded_sampling_is_reproducible(tiny, engine_config, prompt) -> None:
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=7)
    first = Engine(tiny, engine_config).generate(prompt, params)
    assert Engine(tiny, engine_config).generate(prompt, params) == first
    greedy = Engine(tiny, engine_config).generate(prompt, SamplingParams(max_tokens=16))
    assert first.output_ids != greedy.output_ids


def test_eos_and_stop_tokens_finish_a_request(tiny, engine_config, prompt) -> None:
    engine = Engine(tiny, engine_config)
    greedy = engine.generate(prompt, GREEDY_24).output_ids
    stop_at = greedy[5]
    result = engine.generate(prompt, SamplingParams(max_tokens=24, stop_token_ids=(stop_at,)))
    assert result.output_ids == greedy[: greedy.index(stop_at) + 1]
    assert result.finish_reason == FinishReason.STOP


def test_abort_frees_the_request_and_keeps_its_kv_cached(tiny, engine_config, prompt) -> None:
    engine = Engine(tiny, engine_config)
    engine.add_request("r", prompt, GREEDY_24)
    engine.step()
    assert engine.abort("r") is True
    assert engine.abort("r") is False
    assert not engine.has_work()
    stats = engine.stats()
    assert (stats.running, stats.kv_blocks_used, stats.cached_blocks) == (0, 2, 2)


def test_engine_over_a_bigger_config_uses_a_bigger_pool(tiny) -> None:
    engine = Engine(tiny, EngineConfig(num_blocks=100, block_size=8))
    assert engine.pool.k_cache.shape == (4, 100, 8, 2, 64)
