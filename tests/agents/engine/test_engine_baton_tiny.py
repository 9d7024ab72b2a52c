"""The default model baton-tiny: built from a seed, deterministic, and not degenerate."""

from __future__ import annotations

import torch

from agents.engine import (
    BATON_TINY,
    ByteTokenizer,
    Engine,
    EngineConfig,
    SamplingParams,
    build_baton_tiny,
    load_model,
)


def test_two_builds_have_identical_weights_and_other_seeds_differ() -> None:
    a, b, c = build_baton_tiny(0), build_baton_tiny(0), build_baton_tiny(1)
    for (name, wa), wb in zip(
        a.model.state_dict().items(), b.model.state_dict().values(), strict=True
    ):
        assert torch.equal(wa, wb), name
    assert not torch.equal(a.model.lm_head.weight, c.model.lm_head.weight)


def test_greedy_output_is_deterministic_across_builds(tiny) -> None:
    prompt = tiny.tokenizer.encode("Hello, Baton!")
    params = SamplingParams(max_tokens=32)
    first = Engine(tiny).generate(prompt, params).output_ids
    second = Engine(build_baton_tiny(0)).generate(prompt, params).output_ids
    assert first == second


def test_greedy_output_is_not_degenerate(tiny) -> None:
    prompt = tiny.tokenizer.encode("Hello, Baton!")
    result = Engine(tiny, EngineConfig(num_blocks=16)).generate(
        prompt, SamplingParams(max_tokens=64)
    )
    out = result.output_ids
    assert result.finish_reason == "length"  # no EOS straight away
    assert len(set(out)) >= 16  # not one repeated token or a short loop
    assert max(out.count(t) for t in set(out)) <= 16
    assert all(32 <= t < 127 or t == ord("\n") for t in out)  # printable ASCII, no specials


def test_load_model_baton_tiny_uses_the_byte_tokenizer() -> None:
    loaded = load_model(BATON_TINY)
    assert isinstance(loaded.tokenizer, ByteTokenizer)
    assert (loaded.config.num_layers, loaded.config.num_heads, loaded.config.num_kv_heads) == (
        4,
        4,
        2,
    )
    assert loaded.config.vocab_size == ByteTokenizer().vocab_size
