"""The compiled decode step (EngineConfig.decode_compile, agents/engine/decode.py): its math
(the KV copy read only, the new position attended to apart) against the eager fast path, run
uncompiled so that it is quick; then, marked slow, the real torch.compile on a one-layer model:
greedy tokens equal the eager engine's."""

from __future__ import annotations

import shutil

import pytest
import torch

from agents.engine import Engine, EngineConfig, LoadedModel, PagedKVPool, SamplingParams
from agents.engine import decode as decode_module
from agents.engine.batch import SeqChunk, build_forward_batch
from agents.engine.config import ModelConfig
from agents.engine.decode import DecodeState, decode_forward, fuse_projections
from agents.engine.model import CausalLM, rope_inv_freq

BS = 8


def _model(layers: int, seed: int = 0) -> LoadedModel:
    """A small Qwen2-style model (q/k/v biases) with every weight random."""
    cfg = ModelConfig(
        vocab_size=97, hidden_size=64, num_layers=layers, num_heads=4, num_kv_heads=2,
        head_dim=16, intermediate_size=96, max_position=256, attention_bias=True,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = CausalLM(cfg)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.3)
        model.inv_freq.copy_(rope_inv_freq(cfg))
    return LoadedModel(model.eval(), cfg, None)


def _ids(n: int, seed: int, vocab: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=gen).tolist()


@pytest.mark.parametrize("lengths", [[13, 30, 7, 21], [16, 16, 16], [9]], ids=str)
def test_compiled_step_math_equals_the_eager_fast_path(lengths, monkeypatch) -> None:
    loaded = _model(layers=2)
    model, cfg = loaded.model, loaded.config
    fuse_projections(model)
    # The compiled branch, with torch.compile left out: the same math, run eagerly.
    monkeypatch.setattr(decode_module, "_compiled_math", decode_module._decode_math)
    pools = [PagedKVPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 64, BS) for _ in range(2)]
    tables = [pools[0].allocate(8) for _ in lengths]
    for pool in pools[1:]:
        assert [pool.allocate(8) for _ in lengths] == tables
    seqs = [_ids(n, seed=i, vocab=cfg.vocab_size) for i, n in enumerate(lengths)]
    states = [DecodeState(), DecodeState()]
    for pool, state in zip(pools, states, strict=True):
        chunks = [SeqChunk(s[:-1], 0, t) for s, t in zip(seqs, tables, strict=True)]
        model(build_forward_batch(chunks, BS), pool.k_cache, pool.v_cache)
        slots = [pool.slots(t, 0, len(s) - 1) for t, s in zip(tables, seqs, strict=True)]
        flat = (pool.k_cache.flatten(1, 2), pool.v_cache.flatten(1, 2))
        state.rebuild([object() for _ in seqs], [len(s) - 1 for s in seqs], slots, *flat)
    for _ in range(10):
        chunks = [SeqChunk(s[-1:], len(s) - 1, t) for s, t in zip(seqs, tables, strict=True)]
        batch = build_forward_batch(chunks, BS)
        logits = [
            decode_forward(
                model, state, batch.input_ids, batch.write_slots, pool.k_cache, pool.v_cache,
                compiled=compiled,
            )
            for pool, state, compiled in zip(pools, states, (False, True), strict=True)
        ]  # fmt: skip
        eager, split = logits
        assert eager.abs().max() > 1.0
        torch.testing.assert_close(split, eager, atol=2e-4, rtol=2e-4)
        assert split.argmax(-1).tolist() == eager.argmax(-1).tolist()
        for a, b in ((pools[0].k_cache, pools[1].k_cache), (pools[0].v_cache, pools[1].v_cache)):
            torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
        for a, b in ((states[0].k, states[1].k), (states[0].v, states[1].v)):
            torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
        assert states[0].lengths == states[1].lengths
        torch.testing.assert_close(states[1].mask, states[0].mask)
        for s, token in zip(seqs, eager.argmax(-1).tolist(), strict=True):
            s.append(token)


def test_a_compile_that_fails_falls_back_to_the_eager_step(monkeypatch, caplog) -> None:
    """No C++ compiler (or an inductor error): the step runs eagerly, the same tokens, and the
    process says so once and stops trying."""
    loaded = _model(layers=1)
    eager, _ = _greedy(loaded, compiled=False)

    def broken(*args):
        raise RuntimeError("InductorError: CppCompileError: C++ compile error\nno gcc")

    monkeypatch.setattr(decode_module, "_compiled_decode_math", broken)
    monkeypatch.setattr(decode_module, "_compile_error", None)
    with caplog.at_level("WARNING", logger="agents.engine.decode"):
        fallback, _ = _greedy(loaded, compiled=True)
    assert fallback == eager
    assert (
        decode_module._compile_error
        == "RuntimeError: InductorError: CppCompileError: C++ compile error"
    )
    warnings = [r for r in caplog.records if "decode_compile" in r.getMessage()]
    assert len(warnings) == 1


def test_decode_compile_is_validated() -> None:
    assert EngineConfig().decode_compile is False
    with pytest.raises(ValueError, match="decode_compile"):
        EngineConfig(decode_compile=True, decode_weights="int8")
    with pytest.raises(ValueError, match="decode_compile"):
        EngineConfig(decode_compile=True, device="cuda")


def _greedy(loaded: LoadedModel, compiled: bool) -> tuple[dict[str, list[int]], Engine]:
    config = EngineConfig(
        block_size=BS, num_blocks=64, max_running=3, max_queued=8, decode_compile=compiled,
        device="cpu",
    )  # fmt: skip
    engine = Engine(loaded, config)
    vocab = loaded.config.vocab_size
    # Four requests over three running slots: ragged lengths (the mask), a request leaving and
    # a queued one joining (the KV copy rebuilt), never a batch of one (a second graph).
    for i, (n, m) in enumerate([(5, 14), (17, 6), (9, 12), (11, 8)]):
        params = SamplingParams(max_tokens=m, ignore_eos=True)
        engine.add_request(f"r{i}", _ids(n, seed=40 + i, vocab=vocab), params)
    out: dict[str, list[int]] = {}
    while engine.has_work():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.token_ids)
        if len(engine.scheduler.running) == 1 and not engine.scheduler.waiting:
            engine.abort(engine.scheduler.running[0].request_id)  # the same in both runs
    return out, engine


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("c++") is None,
    reason="torch.compile on the CPU needs a C++ compiler",
)
def test_compiled_engine_greedy_tokens_equal_eager() -> None:
    """One layer, batches of 2-3 only: one graph, about 10-20 s to compile on a loaded 2-core
    machine (inductor's cache makes a rerun faster)."""
    loaded = _model(layers=1, seed=1)
    eager, _ = _greedy(loaded, compiled=False)
    compiled, engine = _greedy(loaded, compiled=True)
    assert compiled == eager
    assert engine.runner.fast_steps > 10
