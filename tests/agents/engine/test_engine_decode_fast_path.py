"""The decode fast path (agents/engine/decode.py) against the general forward: same logits up
to float32 reassociation, the same KV written to the pool, identical greedy tokens."""

from __future__ import annotations

import os

import pytest
import torch

from agents.engine import Engine, EngineConfig, LoadedModel, PagedKVPool, SamplingParams
from agents.engine.batch import SeqChunk, build_forward_batch
from agents.engine.decode import DecodeState, decode_forward, fuse_projections

BS = 8
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory) -> LoadedModel:
    """A Qwen2-layout checkpoint (q/k/v biases) with every weight random."""
    from agents.engine import load_hf_checkpoint

    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(
        vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=False,
    )  # fmt: skip
    hf = transformers.Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        for param in hf.parameters():
            param.normal_(0.0, 0.3)
    folder = tmp_path_factory.mktemp("qwen2")
    hf.save_pretrained(folder, safe_serialization=True)
    return load_hf_checkpoint(folder)


def _ids(n: int, seed: int, vocab: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=gen).tolist()


@pytest.mark.parametrize("stream", [False, True], ids=["default", "stream"])
@pytest.mark.parametrize("lengths", [[13, 30, 7, 21], [16, 16, 16]], ids=["ragged", "equal"])
@pytest.mark.parametrize("which", ["tiny", "qwen2"])
def test_fast_path_logits_equal_the_general_forward(which, lengths, stream, tiny, qwen2) -> None:
    """stream: the engine's C++ kernels (skinny linears, decode attention) in the step."""
    from agents.engine import skinny

    if stream and not skinny.available():
        pytest.skip(f"skinny kernels unavailable: {skinny.unavailable_reason()}")
    loaded = tiny if which == "tiny" else qwen2
    model, cfg = loaded.model, loaded.config
    fuse_projections(model)
    pools = [PagedKVPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 64, BS) for _ in range(2)]
    tables = [pools[0].allocate(8) for _ in lengths]
    for pool in pools[1:]:
        assert [pool.allocate(8) for _ in lengths] == tables
    seqs = [_ids(n, seed=i, vocab=cfg.vocab_size) for i, n in enumerate(lengths)]
    for pool in pools:  # the prompts, through the general forward in both pools
        chunks = [SeqChunk(s, 0, t) for s, t in zip(seqs, tables, strict=True)]
        model(build_forward_batch(chunks, BS), pool.k_cache, pool.v_cache)
    general, fast = pools
    state = DecodeState()
    for step in range(12):
        lens = [len(s) for s in seqs]
        chunks = [SeqChunk(s[-1:], len(s) - 1, t) for s, t in zip(seqs, tables, strict=True)]
        # The prompt's last token runs again as a decode step's token at its own position.
        batch = build_forward_batch(chunks, BS)
        want = model(batch, general.k_cache, general.v_cache)  # [B, vocab]
        if step == 0:
            slots = [fast.slots(t, 0, n - 1) for t, n in zip(tables, lens, strict=True)]
            flat = (fast.k_cache.flatten(1, 2), fast.v_cache.flatten(1, 2))
            state.rebuild([object() for _ in seqs], [n - 1 for n in lens], slots, *flat)
        got = decode_forward(
            model, state, batch.input_ids, batch.write_slots, fast.k_cache, fast.v_cache,
            stream=stream,
        )  # fmt: skip
        assert want.abs().max() > 1.0
        torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
        assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
        torch.testing.assert_close(fast.k_cache, general.k_cache, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(fast.v_cache, general.v_cache, atol=1e-5, rtol=1e-5)
        for s, token in zip(seqs, want.argmax(-1).tolist(), strict=True):
            s.append(token)
    assert state.rebuilds == 1  # the copy was built once and appended to after


def _run(loaded: LoadedModel, fast: bool, prompts, max_tokens) -> tuple[dict, Engine]:
    config = EngineConfig(block_size=BS, num_blocks=128, max_running=4, max_queued=8)
    engine = Engine(loaded, config)
    engine.runner.decode_fast_path = fast
    out: dict[str, list[int]] = {}
    for i, (p, n) in enumerate(zip(prompts, max_tokens, strict=True)):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=n, ignore_eos=True))
    while engine.has_work():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.token_ids)
    return out, engine


@pytest.mark.parametrize("which", ["tiny", "qwen2"])
def test_engine_greedy_tokens_are_identical_with_and_without_the_fast_path(
    which, tiny, qwen2
) -> None:
    loaded = tiny if which == "tiny" else qwen2
    vocab = loaded.config.vocab_size
    # Six requests over four running slots, finishing at different steps: the batch changes
    # (requests leave, queued ones prefill and join), so the KV copy is rebuilt several times.
    prompts = [_ids(n, seed=20 + n, vocab=vocab) for n in (5, 17, 9, 33, 12, 1)]
    max_tokens = [30, 12, 25, 8, 20, 16]
    general, _ = _run(loaded, False, prompts, max_tokens)
    fast, engine = _run(loaded, True, prompts, max_tokens)
    assert fast == general
    assert [len(fast[f"r{i}"]) for i in range(6)] == max_tokens
    assert engine.runner.fast_steps > 20
    assert 1 < engine.runner.decode_state.rebuilds < engine.runner.fast_steps


def test_fusion_keeps_the_checkpoint_layout(qwen2) -> None:
    model = qwen2.model
    fuse_projections(model)
    attn = model.model.layers[0].self_attn
    names = set(model.state_dict())
    assert {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.up_proj.weight"} <= names
    assert not any("fused" in n for n in names)
    # The q/k/v parameters are views of the fused weight: no second copy.
    weight, bias = attn._fused_qkv
    assert attn.k_proj.weight.data_ptr() == weight[attn.q_proj.out_features].data_ptr()
    assert attn.v_proj.bias.data_ptr() == bias[-attn.v_proj.out_features].data_ptr()


def test_int8_decode_weights_stay_close_to_float32(qwen2) -> None:
    """int8 weight-only decode (EngineConfig.decode_weights="int8"): an approximation, so only
    closeness is checked here; token agreement is measured in bench/engine/REPORT.md."""
    from agents.engine.decode import quantize_int8

    model, cfg = qwen2.model, qwen2.config
    fuse_projections(model)
    ids = _ids(20, seed=3, vocab=cfg.vocab_size)
    logits = {}
    for int8 in (False, True):
        pool = PagedKVPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 8, BS)
        table = pool.allocate(4)
        model(build_forward_batch([SeqChunk(ids[:-1], 0, table)], BS), pool.k_cache, pool.v_cache)
        batch = build_forward_batch([SeqChunk(ids[-1:], 19, table)], BS)
        state = DecodeState()
        flat = (pool.k_cache.flatten(1, 2), pool.v_cache.flatten(1, 2))
        state.rebuild([object()], [19], [pool.slots(table, 0, 19)], *flat)
        logits[int8] = decode_forward(
            model, state, batch.input_ids, batch.write_slots, pool.k_cache, pool.v_cache, int8=int8
        )[0]
    err = (logits[True] - logits[False]).abs().max() / logits[False].abs().max()
    assert 0 < err < 0.05
    assert len(quantize_int8(model)) == 4 * cfg.num_layers + 1


@pytest.mark.skipif(
    os.environ.get("BATON_ENGINE_DEVICE", "cpu") != "cpu", reason="int8 decode is CPU only"
)
def test_int8_decode_weights_run_in_an_engine_and_are_validated(tiny) -> None:
    loaded = LoadedModel(*tiny)  # the session's model, float32, CPU
    config = EngineConfig(
        block_size=BS, num_blocks=32, max_running=2, decode_weights="int8", device="cpu"
    )
    out = Engine(loaded, config).generate(list(range(10, 30)), SamplingParams(max_tokens=8))
    assert len(out.output_ids) == 8
    with pytest.raises(ValueError, match="must be None, 'int8', 'packed' or 'stream'"):
        EngineConfig(decode_weights="int4")
    with pytest.raises(ValueError, match="CPU only"):
        EngineConfig(decode_weights="int8", device="cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_packed_decode_weights_give_the_dense_steps_logits(dtype, qwen2) -> None:
    """decode_weights="packed": the same weights in oneDNN's layout, so the logits equal the
    dense weights' up to reassociation (bfloat16: rounding of the same products)."""
    from agents.engine.decode import _ONEDNN, prepack_weights

    if not _ONEDNN:
        pytest.skip("no oneDNN in this torch build")
    model = _model_in(qwen2, dtype)
    cfg = qwen2.config
    fuse_projections(model)
    ids = [_ids(20, seed=3 + i, vocab=cfg.vocab_size) for i in range(3)]
    logits = {}
    for packed in (False, True):
        pool = PagedKVPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 16, BS, dtype=dtype)
        tables = [pool.allocate(4) for _ in ids]
        chunks = [SeqChunk(s[:-1], 0, t) for s, t in zip(ids, tables, strict=True)]
        model(build_forward_batch(chunks, BS), pool.k_cache, pool.v_cache)
        chunks = [SeqChunk(s[-1:], 19, t) for s, t in zip(ids, tables, strict=True)]
        batch = build_forward_batch(chunks, BS)
        state = DecodeState()
        flat = (pool.k_cache.flatten(1, 2), pool.v_cache.flatten(1, 2))
        state.rebuild([object()] * 3, [19] * 3, [pool.slots(t, 0, 19) for t in tables], *flat)
        logits[packed] = decode_forward(
            model, state, batch.input_ids, batch.write_slots, pool.k_cache, pool.v_cache,
            packed=packed,
        )  # fmt: skip
    tol = 2e-4 if dtype == torch.float32 else 0.1
    torch.testing.assert_close(logits[True], logits[False], atol=tol, rtol=tol)
    # Every decode weight is packed, or none where oneDNN has no kernel for the dtype on this
    # CPU (bfloat16 without AVX512-BF16 / AMX): those keep the dense path, same logits.
    packs = _onednn_packs(dtype)
    assert len(prepack_weights(model)) == (4 * cfg.num_layers + 1 if packs else 0)


def _onednn_packs(dtype: torch.dtype) -> bool:
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.ones(8, 8, dtype=dtype), 8)
    except RuntimeError:
        return False
    return True


def _model_in(loaded: LoadedModel, dtype: torch.dtype) -> torch.nn.Module:
    """A copy of the model in `dtype` (the module fixture stays float32)."""
    import copy

    return copy.deepcopy(loaded.model).to(dtype)


@pytest.mark.skipif(
    os.environ.get("BATON_ENGINE_DEVICE", "cpu") != "cpu", reason="packed decode is CPU only"
)
def test_packed_decode_weights_keep_the_engines_greedy_tokens(tiny) -> None:
    prompts = [_ids(n, seed=50 + n, vocab=tiny.config.vocab_size) for n in (7, 19, 12)]
    out = {}
    for weights in (None, "packed"):
        config = EngineConfig(
            block_size=BS, num_blocks=64, max_running=4, decode_weights=weights, device="cpu"
        )
        engine = Engine(LoadedModel(*tiny), config)
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, SamplingParams(max_tokens=16, ignore_eos=True))
        tokens: dict[str, list[int]] = {}
        while engine.has_work():
            for o in engine.step():
                tokens.setdefault(o.request_id, []).extend(o.token_ids)
        out[weights] = tokens
    assert out["packed"] == out[None]
    with pytest.raises(ValueError, match="CPU only"):
        EngineConfig(decode_weights="packed", device="cuda")


def test_a_dtype_onednn_refuses_falls_back_to_mkl_for_good(monkeypatch) -> None:
    """A CPU whose oneDNN has no bfloat16 inner product (no AVX512-BF16/AMX) raises on the
    first call; the step goes on through F.linear and does not try oneDNN again."""
    from agents.engine import decode

    calls = []

    def refuses(x, weight, bias):
        calls.append(x.dtype)
        raise RuntimeError("could not create a primitive descriptor")

    monkeypatch.setattr(decode, "_ONEDNN", True)
    monkeypatch.setattr(decode, "_ONEDNN_DTYPES", {torch.float32, torch.bfloat16})
    monkeypatch.setattr(decode, "_onednn_linear", refuses)
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    w = torch.randn(8, 16, dtype=torch.bfloat16)
    expected = torch.nn.functional.linear(x, w)
    assert torch.equal(decode._linear(x, w), expected)
    assert torch.equal(decode._linear(x, w), expected)
    assert calls == [torch.bfloat16]  # tried once, then MKL only
    assert {torch.float32} == decode._ONEDNN_DTYPES
