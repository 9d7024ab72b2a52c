"""The skinny-linear kernel (agents/engine/skinny.py) and `decode_weights="stream"`: the
kernel against F.linear at every row count it takes, its errors, its build and the engine's
greedy tokens with it. Where the CPU cannot run it the engine keeps its default linears."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest
import torch
import torch.nn.functional as F

from agents.engine import (
    Engine,
    EngineConfig,
    LoadedModel,
    SamplingParams,
    build_baton_tiny,
    skinny,
)

cpu_only = pytest.mark.skipif(
    os.environ.get("BATON_ENGINE_DEVICE", "cpu") != "cpu", reason="the kernel is CPU only"
)
needs_kernel = pytest.mark.skipif(
    not skinny.available(), reason=f"skinny kernel unavailable: {skinny.unavailable_reason()}"
)


def test_the_kernel_runs_here_or_says_why() -> None:
    if skinny.cpu_support():
        assert not skinny.available()
        assert "lacks" in skinny.unavailable_reason()
    else:  # a CPU with the instructions: it must build and load (a compiler is on every box)
        assert skinny.available(), skinny.unavailable_reason()
        assert skinny.library_path().is_file()


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 12, 16, 20, 32, 64])
def test_the_kernel_equals_f_linear(dtype, rows) -> None:
    gen = torch.Generator().manual_seed(rows)
    # N not a multiple of the panel (zero-padded), K odd in float32, a bias or none; in
    # bfloat16 K a multiple of 32 (AMX where the CPU has it) and not (AVX512-BF16 or FMA).
    for n, k in ((100, 64), (48, 30), (130, 70), (7, 2), (50, 96)):
        if dtype == torch.bfloat16 and k % 2:
            continue
        w = (torch.randn(n, k, generator=gen) * 0.1).to(dtype)
        x = torch.randn(rows, k, generator=gen).to(dtype)
        b = torch.randn(n, generator=gen).to(dtype)
        packed = skinny.pack(w)
        assert packed.shape[0] == -(-n // skinny.panel())
        for bias in (None, b):
            got = skinny.linear(x, packed, n, bias)
            assert got.dtype == dtype and got.shape == (rows, n)
            ref = F.linear(x.float(), w.float(), None if bias is None else bias.float())
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(got.float(), ref, atol=tol, rtol=tol)


@needs_kernel
def test_amx_runs_where_the_cpu_has_it_and_can_be_turned_off() -> None:
    """bfloat16 linears go through AMX on an AVX-512 build whose CPU has AMX-TILE and AMX-BF16
    (unless BATON_AMX=0), never elsewhere; BATON_AMX=0 in a fresh process turns it off and
    the AVX512-BF16 kernel gives the same outputs within bfloat16's rounding."""
    flags = skinny._cpu_flags()
    has_amx = isinstance(flags, set) and {"amx_tile", "amx_bf16"} <= flags
    if not has_amx or skinny.isa()[0] != "avx512":
        assert not skinny.amx()
    elif os.environ.get("BATON_AMX") != "0":
        assert skinny.amx()  # a Linux new enough to grant the tile state (5.16 and later)
    script = (
        "import sys, torch\n"
        "from agents.engine import skinny\n"
        "assert skinny.available()\n"
        "g = torch.Generator().manual_seed(3)\n"
        "w = torch.randn(100, 96, generator=g).bfloat16()\n"
        "x = torch.randn(20, 96, generator=g).bfloat16()\n"
        "torch.save((skinny.amx(), skinny.linear(x, skinny.pack(w), 100)), sys.argv[1])\n"
    )
    outs = []
    with tempfile.TemporaryDirectory() as tmp:
        for value in ("1", "0"):
            path = f"{tmp}/{value}.pt"
            env = {**os.environ, "BATON_AMX": value}
            subprocess.run([sys.executable, "-c", script, path], env=env, check=True)
            outs.append(torch.load(path))
    (amx_on, y_on), (amx_off, y_off) = outs
    assert amx_off is False
    if os.environ.get("BATON_AMX") != "0":
        assert amx_on == skinny.amx()
    torch.testing.assert_close(y_on.float(), y_off.float(), atol=2e-2, rtol=2e-2)


@needs_kernel
def test_the_kernel_refuses_what_it_cannot_do() -> None:
    w = torch.randn(50, 32)
    packed = skinny.pack(w)
    with pytest.raises(RuntimeError, match=f"1 to {skinny.MAX_ROWS} rows"):
        skinny.linear(torch.randn(skinny.MAX_ROWS + 1, 32), packed, 50)
    with pytest.raises(RuntimeError, match="does not match N and K"):
        skinny.linear(torch.randn(4, 32), packed, 200)
    with pytest.raises(RuntimeError, match="dtypes differ"):
        skinny.linear(torch.randn(4, 32).bfloat16(), packed, 50)
    with pytest.raises(RuntimeError, match="bias must be"):
        skinny.linear(torch.randn(4, 32), packed, 50, torch.randn(49))
    with pytest.raises(ValueError, match="cannot pack"):
        skinny.pack(torch.randn(8, 3).bfloat16())  # odd K in bfloat16
    with pytest.raises(ValueError, match="cannot pack"):
        skinny.pack(torch.randn(8, 4).half())


def test_the_library_name_follows_its_source(tmp_path, monkeypatch) -> None:
    """An edited kernel (or another torch) builds a library of its own: a stale one is never
    loaded."""
    before = skinny.library_path()
    edited = tmp_path / "skinny_linear.cpp"
    edited.write_text(skinny.SOURCE.read_text() + "\n// edited\n")
    monkeypatch.setattr(skinny, "SOURCE", edited)
    assert skinny.library_path() != before
    assert skinny.library_path().parent == before.parent


def test_a_compiler_failure_is_one_line(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("CXX", "false")
    with pytest.raises(RuntimeError, match="the C..? compiler failed"):
        skinny.build(tmp_path / "x.so")
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(RuntimeError, match="cannot run the C\\+\\+ compiler"):
        skinny.build(tmp_path / "x.so")
    assert list(tmp_path.iterdir()) == []  # no half-written library left behind


def test_the_cli_reports_status(capsys) -> None:
    assert skinny.main(["status"]) == 0
    assert "skinny linears:" in capsys.readouterr().out
    assert skinny.main(["bogus"]) == 2
    assert skinny.main(["build"]) == 0  # up to date, built now, or nothing to build here
    assert "skinny linears:" in capsys.readouterr().out


def _greedy(tiny: LoadedModel, weights: str | None, dtype: str) -> dict[str, list[int]]:
    loaded = build_baton_tiny(seed=0)  # its own copy: the engine casts it in place
    config = EngineConfig(
        block_size=16, num_blocks=64, max_running=8, decode_weights=weights, dtype=dtype,
        device="cpu",
    )  # fmt: skip
    engine = Engine(loaded, config)
    vocab = tiny.config.vocab_size
    for i in range(6):
        prompt = [(7 * i + 3 * j) % (vocab - 2) + 1 for j in range(9 + 5 * i)]
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=12, ignore_eos=True))
    tokens: dict[str, list[int]] = {}
    while engine.has_work():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
    return tokens


@cpu_only
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_stream_decode_weights_keep_the_engines_greedy_tokens(tiny, dtype) -> None:
    """decode_weights="stream" (the kernel's copies in fast-path decode steps) gives the
    default engine's greedy tokens; where the kernel cannot run, the default linears do."""
    from agents.engine import decode

    calls = []

    def counted(*args):
        calls.append(args[0].shape[0])
        return skinny.torch.ops.baton.skinny_linear(*args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(decode.skinny, "linear", counted)
        streamed = _greedy(tiny, "stream", dtype)
    default = _greedy(tiny, None, dtype)
    if dtype == "float32":
        assert streamed == default
    else:
        # bfloat16 rounds each output of a differently ordered float32 sum (the kernel's, or
        # torch's, which differs by CPU): a near tie can flip a rounding and then a token of
        # this random tiny model. Seen: equal on an AVX-512 CPU; on an AVX2 one, 4 of 6
        # requests equal, one off after 2 of 12 tokens. Most must agree, in full.
        assert streamed.keys() == default.keys()
        assert all(len(streamed[r]) == len(default[r]) == 12 for r in default)
        assert sum(streamed[r] == default[r] for r in default) >= len(default) // 2
    if skinny.available():  # the decode steps went through the kernel, at 1-6 rows
        assert calls and set(calls) <= set(range(1, 7))
    else:
        assert calls == []
    with pytest.raises(ValueError, match="CPU only"):
        EngineConfig(decode_weights="stream", device="cuda")


@needs_kernel
@cpu_only
def test_stream_weights_pack_every_decode_linear_once(tiny) -> None:
    from agents.engine.decode import fuse_projections, stream_weights

    model = build_baton_tiny(seed=0).model
    fuse_projections(model)
    packed = stream_weights(model)
    assert len(packed) == 4 * tiny.config.num_layers + 1  # qkv, o, gate/up, down; lm_head
    assert stream_weights(model) is packed  # cached on the model
    rows = {n for _, n in packed.values()}
    assert tiny.config.vocab_size in rows


@needs_kernel
@pytest.mark.parametrize(("heads", "group", "dim"), [(2, 4, 64), (1, 1, 16), (3, 2, 128)])
def test_decode_attention_equals_masked_softmax(heads, group, dim) -> None:
    """The decode attention against matmul + masked softmax + matmul, ragged key counts, over
    a slice of a larger KV copy (as the engine passes it)."""
    gen = torch.Generator().manual_seed(dim)
    batch, capacity = 5, 80
    k = torch.randn(batch, heads, capacity, dim, generator=gen)
    v = torch.randn(batch, heads, capacity, dim, generator=gen)
    q = torch.randn(batch, heads, group, dim, generator=gen) * dim**-0.5
    counts = torch.tensor([1, 17, 60, 33, 60])
    k_max = int(counts.max())
    keys = torch.arange(k_max)
    mask = torch.where(keys[None, :] < counts[:, None], 0.0, -torch.inf)[:, None, None, :]
    scores = torch.matmul(q, k[:, :, :k_max].transpose(-1, -2)) + mask
    want = torch.matmul(torch.softmax(scores, dim=-1), v[:, :, :k_max])
    got = skinny.attention(q, k[:, :, :k_max], v[:, :, :k_max], counts)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@needs_kernel
def test_decode_attention_refuses_what_it_cannot_do() -> None:
    k = torch.randn(2, 1, 8, 16)
    q = torch.randn(2, 1, 1, 16)
    with pytest.raises(RuntimeError, match="length out of range"):
        skinny.attention(q, k, k, torch.tensor([3, 9]))
    with pytest.raises(RuntimeError, match="length out of range"):
        skinny.attention(q, k, k, torch.tensor([0, 2]))
    with pytest.raises(RuntimeError, match="multiple of 16"):
        skinny.attention(torch.randn(2, 1, 1, 8), torch.randn(2, 1, 8, 8), torch.randn(2, 1, 8, 8),
                         torch.tensor([1, 1]))  # fmt: skip
    with pytest.raises(RuntimeError, match="float32"):
        skinny.attention(q.bfloat16(), k.bfloat16(), k.bfloat16(), torch.tensor([1, 1]))
    with pytest.raises(RuntimeError, match="int64"):
        skinny.attention(q, k, k, torch.tensor([1, 1], dtype=torch.int32))
    assert not skinny.attention_supported(k.bfloat16(), 16)
    assert not skinny.attention_supported(k, 24)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("rows", "hidden"), [(8, 512), (3, 70), (1, 16)])
def test_rms_norm_and_silu_mul_equal_the_engines_torch_ops(dtype, rows, hidden) -> None:
    """The engine's RMSNorm (float32: F.rms_norm; bfloat16: normalised in float32, rounded,
    times the weight) and silu(gate) * up: equal in bfloat16, within float32 rounding."""
    gen = torch.Generator().manual_seed(rows * hidden)
    x = torch.randn(rows, hidden, generator=gen).to(dtype)
    w = (torch.randn(hidden, generator=gen) * 0.5 + 1).to(dtype)
    if dtype == torch.float32:
        want = F.rms_norm(x, (hidden,), w, 1e-6)
    else:
        want = w * F.rms_norm(x.float(), (hidden,), None, 1e-6).to(dtype)
    gate_up = torch.randn(rows, 2 * hidden, generator=gen).to(dtype) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    want_act = F.silu(gate) * up
    got, got_act = skinny.rms_norm(x, w, 1e-6), skinny.silu_mul(gate_up)
    if dtype == torch.bfloat16:
        assert torch.equal(got, want) and torch.equal(got_act, want_act)
    else:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(got_act, want_act, atol=1e-5, rtol=1e-6)
    with pytest.raises(RuntimeError, match="x \\[M, H\\] and w \\[H\\]"):
        skinny.rms_norm(x, w[:-1], 1e-6)
    with pytest.raises(RuntimeError, match="gate_up \\[M, 2I\\]"):
        skinny.silu_mul(gate_up[:, :-1])


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rope_equals_the_engines_torch_ops(dtype) -> None:
    """x * cos + rotate_half(x) * sin on the first heads of qkv: equal, bit for bit."""
    gen = torch.Generator().manual_seed(3)
    batch, heads, kv_heads, dim = 5, 4, 2, 64
    qkv = torch.randn(batch, heads + 2 * kv_heads, dim, generator=gen).to(dtype)
    angle = torch.rand(batch, 1, dim, generator=gen) * 6
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    qk = qkv[:, : heads + kv_heads]
    half = dim // 2
    want = qk * cos + torch.cat((-qk[..., half:], qk[..., :half]), dim=-1) * sin
    assert torch.equal(skinny.rope(qkv, cos, sin, heads + kv_heads), want)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        skinny.rope(qkv[..., :16], cos[..., :16], sin[..., :16], 2)
    with pytest.raises(RuntimeError, match="1 to NH heads"):
        skinny.rope(qkv, cos, sin, 9)


def test_the_instruction_set_is_the_best_the_cpu_has(monkeypatch) -> None:
    """AVX-512 with AVX512-BF16 where the CPU has it, else AVX2 with FMA, else none (and
    why); $BATON_KERNEL_ISA picks one the CPU has, and names what it lacks otherwise."""
    avx2 = {"sse2", "avx", "avx2", "fma"}
    avx512 = avx2 | {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"}
    monkeypatch.delenv("BATON_KERNEL_ISA", raising=False)
    monkeypatch.setattr(skinny, "_cpu_flags", lambda: avx512)
    assert skinny.isa() == ("avx512", "")
    assert "-mavx512bf16" in skinny.cxxflags()
    monkeypatch.setattr(skinny, "_cpu_flags", lambda: avx2)
    assert skinny.isa() == ("avx2", "")
    assert "-mavx2" in skinny.cxxflags() and "-mavx512f" not in skinny.cxxflags()
    assert "-avx2-" in skinny.library_path().name  # a library per instruction set
    monkeypatch.setattr(skinny, "_cpu_flags", lambda: {"sse2", "avx"})
    assert skinny.isa() == ("", "the CPU lacks avx2, fma")
    monkeypatch.setattr(skinny, "_cpu_flags", lambda: avx512)
    monkeypatch.setenv("BATON_KERNEL_ISA", "avx2")
    assert skinny.isa() == ("avx2", "")
    monkeypatch.setattr(skinny, "_cpu_flags", lambda: avx2)
    monkeypatch.setenv("BATON_KERNEL_ISA", "avx512")
    assert skinny.isa()[1] == (
        "BATON_KERNEL_ISA=avx512: the CPU lacks avx512f, avx512bw, avx512vl, avx512_bf16"
    )
    monkeypatch.setenv("BATON_KERNEL_ISA", "neon")
    assert skinny.isa()[1] == "BATON_KERNEL_ISA=neon: not one of avx512, avx2"


@needs_kernel
def test_silu_mul_at_extreme_gates() -> None:
    """exp() clamps: gates far below and above zero give silu's limits, never NaN."""
    gate = torch.tensor([[-200.0, -88.5, -87.0, -20.0, 0.0, 20.0, 88.0, 200.0]])
    up = torch.ones_like(gate)
    got = skinny.silu_mul(torch.cat((gate, up), dim=1))
    torch.testing.assert_close(got, F.silu(gate), atol=1e-6, rtol=1e-6)


def _wide_heads_model(dtype: torch.dtype) -> torch.nn.Module:
    """Qwen2-style layers (q/k/v biases) with 32-wide heads, which decode_layers takes, and an
    MLP width that is no multiple of a vector (the kernels' tails)."""
    from agents.engine.config import ModelConfig
    from agents.engine.model import CausalLM

    cfg = ModelConfig(
        vocab_size=300, hidden_size=128, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=32,
        intermediate_size=200, attention_bias=True, name="qwen2",
    )  # fmt: skip
    torch.manual_seed(5)
    model = CausalLM(cfg)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, 0.3 if param.dim() == 1 else param.shape[-1] ** -0.5)
    return model.to(dtype).eval()


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("lengths", [[9, 30, 17], [5 + 3 * i for i in range(20)]], ids=len)
def test_decode_layers_in_one_call_equal_the_op_by_op_step(dtype, lengths, monkeypatch) -> None:
    """A stream step's decoder layers in one C++ call give the op-by-op stream step's logits,
    pool and KV copy bit for bit, at ragged lengths, step after step (3 requests, and 20:
    several passes of rows over each panel)."""
    from agents.engine import PagedKVPool
    from agents.engine.batch import SeqChunk, build_forward_batch
    from agents.engine.decode import DecodeState, decode_forward, fuse_projections

    model = _wide_heads_model(dtype)
    fuse_projections(model)
    cfg = model.config
    calls = []
    one_call = skinny.decode_layers
    monkeypatch.setattr(skinny, "decode_layers", lambda *a: calls.append(1) or one_call(*a))
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    runs = {}
    for whole in (True, False):
        pool = PagedKVPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 200, 8, dtype=dtype)
        tables = [pool.allocate(-(-(len(s) + 6) // 8)) for s in seqs]
        chunks = [SeqChunk(s[:-1], 0, t) for s, t in zip(seqs, tables, strict=True)]
        model(build_forward_batch(chunks, 8), pool.k_cache, pool.v_cache)
        state = DecodeState()
        flat = (pool.k_cache.flatten(1, 2), pool.v_cache.flatten(1, 2))
        slots = [pool.slots(t, 0, len(s) - 1) for s, t in zip(seqs, tables, strict=True)]
        state.rebuild([object() for _ in seqs], [len(s) - 1 for s in seqs], slots, *flat)
        tokens = [s[-1] for s in seqs]
        logits = []
        with monkeypatch.context() as patch:
            if not whole:
                patch.setattr("agents.engine.decode.stream_layers", lambda model: None)
            for step in range(5):
                positions = [len(s) - 1 + step for s in seqs]
                at = zip(tokens, positions, tables, strict=True)
                chunks = [SeqChunk([tok], p, t) for tok, p, t in at]
                batch = build_forward_batch(chunks, 8)
                out = decode_forward(
                    model, state, batch.input_ids, batch.write_slots, pool.k_cache,
                    pool.v_cache, stream=True,
                )  # fmt: skip
                logits.append(out)
                tokens = out.argmax(-1).tolist()
        runs[whole] = (logits, pool.k_cache, pool.v_cache, state.k, state.v)
    assert len(calls) == 5  # every step of the first run in one call, none of the second
    for got, want in zip(runs[True], runs[False], strict=True):
        if isinstance(got, list):
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        else:
            assert torch.equal(got, want)


@needs_kernel
def test_decode_layers_refuses_what_it_cannot_do() -> None:
    x = torch.randn(2, 64)
    pool = torch.zeros(1, 16, 2, 32)
    copy = torch.zeros(1, 2, 2, 8, 32)
    slots, pos, lens = torch.tensor([0, 1]), torch.tensor([3, 4]), torch.tensor([4, 5])
    cs = torch.ones(2, 32)
    norms = [torch.ones(64)] * 2
    shapes = [(256, 64), (64, 128), (96, 64), (64, 48)]  # qkv, o, gate/up, down
    packed = [skinny.pack(torch.randn(n, k)) for n, k in shapes]
    sizes = [n for n, _ in shapes]

    def call(**kw):
        args = dict(x=x, norms=norms, packed=packed, biases=[None] * 4, out_features=sizes,
                    eps=1e-6, cos=cs, sin=cs, k_pool=pool, v_pool=pool.clone(),
                    write_slots=slots, k_copy=copy, v_copy=copy.clone(), positions=pos,
                    lengths=lens, heads=4, kv_heads=2, scale=0.2)  # fmt: skip
        args.update(kw)
        return skinny.decode_layers(**args)

    assert call().shape == (2, 64)
    with pytest.raises(RuntimeError, match="2 norms and 4 linears per layer"):
        call(norms=norms[:1])
    with pytest.raises(RuntimeError, match="linear 1 has 60 outputs, expected 64"):
        call(out_features=[256, 60, 96, 64])
    with pytest.raises(RuntimeError, match="write slot out of range"):
        call(write_slots=torch.tensor([0, 16]))
    with pytest.raises(RuntimeError, match="position or length out of range"):
        call(lengths=torch.tensor([4, 9]))
    with pytest.raises(RuntimeError, match="in x's dtype"):
        call(x=x.bfloat16())
