"""Decode fast path: a forward for steps where every request runs exactly one new token.

The general forward (`CausalLM.forward`) gathers every request's whole KV out of the paged pool
each step, builds a boolean mask and runs SDPA over the padded batch. Here, for consecutive
decode steps of the same requests, each request's KV lives in a persistent per-batch copy
(`DecodeState`, [L, B, KVH, capacity, D]): a step appends its one new position (and writes it
to the pool too, which stays the source of truth for export, the prefix cache and later
forwards) and attends over a view of the copy, with grouped-query attention as two batched
matmuls (no KV repeat) and an additive mask only when the requests' lengths differ. The copy is
rebuilt from the pool whenever the batch changes (a request joins, leaves or was recomputed).

`decode_forward(..., compiled=True)` (EngineConfig.decode_compile) runs the same step through
`torch.compile` (inductor, dynamic shapes, frozen weights): the layers' math as one graph that
only reads the KV copy (the new position's key and value are attended to separately and written
afterwards, so the graph mutates none of its inputs), which fuses the small element-wise ops
and multiplies by prepacked oneDNN weights (a second copy of the linears' weights).

`decode_forward(..., stream=True)` (EngineConfig.decode_weights="stream") multiplies by the
skinny kernel's packed copies of the linears (agents/engine/skinny.py) at 1-64 rows: one
sequential pass over each weight, against MKL's and oneDNN's partial one at these shapes; and
where every kernel applies, all the decoder layers of the step in one C++ call
(skinny.decode_layers, run by one team of threads).

Also: fused QKV and gate/up projections (`fuse_projections`: the checkpoint's q/k/v and
gate/up parameters become views of one fused tensor, so the state dict keeps its layout and no
memory is added), a precomputed RoPE table and `F.rms_norm`. The results equal the general
path's up to float reassociation (tests/agents/engine/test_engine_decode_fast_path.py)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from agents.engine import skinny
from agents.engine.model import CausalLM, RMSNorm

log = logging.getLogger(__name__)

_CAPACITY_STEP = 64  # KV copy capacity grows in multiples of this many positions


def _fuse(linears: Sequence[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the linears' weights (and biases) along the output axis and rebind each
    linear's parameters as views of the result; returns (weight, bias)."""
    with torch.inference_mode(False), torch.no_grad():
        weight = torch.cat([lin.weight.detach() for lin in linears])
        has_bias = [lin.bias is not None for lin in linears]
        bias = None
        if all(has_bias):
            bias = torch.cat([lin.bias.detach() for lin in linears])
        elif any(has_bias):  # mixed biases: fuse with zeros where one is missing
            bias = torch.cat(
                [
                    lin.bias.detach()
                    if lin.bias is not None
                    else weight.new_zeros(lin.out_features)
                    for lin in linears
                ]
            )
        start = 0
        for lin, own_bias in zip(linears, has_bias, strict=True):
            end = start + lin.out_features
            lin.weight = nn.Parameter(weight[start:end], requires_grad=False)
            if own_bias:
                lin.bias = nn.Parameter(bias[start:end], requires_grad=False)
            start = end
    return weight, bias


def _fused_still_shared(linears: Sequence[nn.Linear], fused: tuple) -> bool:
    weight = fused[0]
    start = 0
    for lin in linears:
        w = lin.weight
        if (
            w.untyped_storage().data_ptr() != weight.untyped_storage().data_ptr()
            or w.data_ptr() != weight[start].data_ptr()
            or w.dtype != weight.dtype
        ):
            return False
        start += lin.out_features
    return True


def fuse_projections(model: CausalLM) -> None:
    """Fuse q/k/v and gate/up of every layer (idempotent; redone after a cast or a move)."""
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = (attn.q_proj, attn.k_proj, attn.v_proj)
        gate_up = (mlp.gate_proj, mlp.up_proj)
        fused = getattr(attn, "_fused_qkv", None)
        if fused is None or not _fused_still_shared(qkv, fused):
            attn._fused_qkv = _fuse(qkv)
        fused = getattr(mlp, "_fused_gate_up", None)
        if fused is None or not _fused_still_shared(gate_up, fused):
            mlp._fused_gate_up = _fuse(gate_up)


def rope_table(model: CausalLM, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """(cos, sin) [>= length, D] in `dtype`, cached on the model; the values equal the general
    path's (the same float32 products, then cos / sin, then the cast)."""
    inv_freq = model.inv_freq
    cached = getattr(model, "_rope_table", None)
    if (
        cached is None
        or cached[0].shape[0] < length
        or cached[0].dtype != dtype
        or cached[0].device != inv_freq.device
    ):
        size = min(model.config.max_position, max(length, 1024))
        size = max(size, length)
        freqs = torch.arange(size, device=inv_freq.device).float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cached = (emb.cos().to(dtype), emb.sin().to(dtype))
        model._rope_table = cached
    return cached


def _onednn_linear_available() -> bool:
    try:
        return torch.backends.mkldnn.is_available() and hasattr(
            torch.ops.mkldnn, "_linear_pointwise"
        )
    except (AttributeError, RuntimeError):
        return False


_ONEDNN = _onednn_linear_available()


def _onednn_linear(x, weight, bias):
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


_ONEDNN_DTYPES = {torch.float32, torch.bfloat16}  # a dtype oneDNN refused is dropped
ONEDNN_MIN_ROWS = 2  # one row: MKL gemv was as fast or faster on small weights


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """`F.linear`, through oneDNN on the CPU for a few rows at a time: at 8-32 rows MKL's
    sgemm reached about half oneDNN's speed on the 2-core AMD EPYC we measure on (bench/engine/
    REPORT.md); results differ only by float reassociation."""
    if (
        _ONEDNN
        and x.device.type == "cpu"
        and x.shape[0] >= ONEDNN_MIN_ROWS
        and x.dtype in _ONEDNN_DTYPES
        and weight.is_contiguous()
    ):
        try:
            return _onednn_linear(x, weight, bias)
        except RuntimeError:
            # oneDNN builds its primitive for the CPU it finds; where it has none for this
            # dtype (bfloat16 on a CPU without AVX512-BF16/AMX, seen on a CI machine) every
            # later call would fail the same way: use MKL for that dtype from now on.
            _ONEDNN_DTYPES.discard(x.dtype)
    return F.linear(x, weight, bias)


def _decode_weights(model: CausalLM) -> list[torch.Tensor]:
    """The weights a decode step multiplies by (fused where fused)."""
    out = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        out += [attn._fused_qkv[0], attn.o_proj.weight, mlp._fused_gate_up[0]]
        out.append(mlp.down_proj.weight)
    return [*out, model.lm_head.weight]


def quantize_int8(model: CausalLM) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Int8 weight-only copies (symmetric, one scale per output row) of the decode step's
    weights, keyed by the float weight's data pointer; cached on the model, redone when the
    weights were replaced (a cast, a move, a reload)."""
    cached = getattr(model, "_int8_weights", None)
    if cached is not None and model.lm_head.weight.data_ptr() in cached:
        return cached
    cached = {}
    with torch.inference_mode(False), torch.no_grad():
        for weight in _decode_weights(model):
            w = weight.detach().float()
            scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
            q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
            cached[weight.data_ptr()] = (q.contiguous(), scale.to(torch.bfloat16))
    model._int8_weights = cached
    return cached


PACK_ROWS = 8  # the batch oneDNN lays the prepacked weights out for (fine at 2-32 rows)


def prepack_weights(model: CausalLM) -> dict[int, torch.Tensor]:
    """oneDNN-prepacked copies (its blocked layout for a few rows) of the decode step's
    weights, keyed by the dense weight's data pointer; cached on the model, redone when the
    weights were replaced. A weight oneDNN cannot pack (a dtype this CPU lacks) is left out
    and keeps the dense path."""
    cached = getattr(model, "_packed_weights", None)
    if cached is not None and model.lm_head.weight.data_ptr() in cached:
        return cached
    cached = {}
    if _ONEDNN:
        with torch.inference_mode(False), torch.no_grad():
            for weight in _decode_weights(model):
                if weight.device.type != "cpu" or weight.dtype not in _ONEDNN_DTYPES:
                    continue
                try:
                    w = weight.detach().contiguous()
                    packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS)
                except RuntimeError:
                    continue
                cached[weight.data_ptr()] = packed
    model._packed_weights = cached
    return cached


def _packed_linear(x, weight, bias, packed: dict[int, torch.Tensor]) -> torch.Tensor:
    """x @ W.T with W's prepacked copy: float32 from 2 rows (one row: MKL's gemv on the dense
    weight was as fast), bfloat16 from one row (1.5x the dense weight at 1-8 rows here)."""
    p = packed.get(weight.data_ptr())
    if p is not None and (x.shape[0] >= ONEDNN_MIN_ROWS or x.dtype != torch.float32):
        try:
            return torch.ops.mkldnn._linear_pointwise(x, p, bias, "none", [], "")
        except RuntimeError:
            packed.pop(weight.data_ptr(), None)  # never again for this weight
    return _linear(x, weight, bias)


def stream_weights(model: CausalLM) -> dict[int, tuple[torch.Tensor, int]]:
    """The skinny kernel's packed copies (agents/engine/skinny.py) of the decode step's
    weights with their row counts, keyed by the dense weight's data pointer; cached on the
    model, redone when the weights were replaced. Empty where the kernel does not run."""
    cached = getattr(model, "_stream_weights", None)
    if cached is not None and model.lm_head.weight.data_ptr() in cached:
        return cached
    cached = {}
    if skinny.available():
        with torch.inference_mode(False), torch.no_grad():
            for weight in _decode_weights(model):
                if skinny.supports(weight):
                    cached[weight.data_ptr()] = (skinny.pack(weight), weight.shape[0])
    model._stream_weights = cached
    return cached


def stream_layers(model: CausalLM) -> tuple | None:
    """What skinny.decode_layers takes for the model's decoder layers: (norm weights, packed
    linears, their biases, their output sizes, eps), from stream_weights' copies; None where a
    linear has no packed copy or the norms' eps differ. Cached with stream_weights."""
    packed = stream_weights(model)
    cached = getattr(model, "_stream_layers", None)
    if cached is not None and cached[0] is packed:
        return cached[1]
    model._stream_layers = (packed, _stream_layer_args(model, packed))
    return model._stream_layers[1]


def _stream_layer_args(model: CausalLM, packed: dict[int, tuple[torch.Tensor, int]]):
    layers = model.model.layers
    eps = {
        n.eps for layer in layers for n in (layer.input_layernorm, layer.post_attention_layernorm)
    }
    if len(eps) != 1:
        return None
    norms: list[torch.Tensor] = []
    weights: list[torch.Tensor] = []
    biases: list[torch.Tensor | None] = []
    sizes: list[int] = []
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        norms += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
        for weight, bias in (
            attn._fused_qkv,
            (attn.o_proj.weight, attn.o_proj.bias),
            mlp._fused_gate_up,
            (mlp.down_proj.weight, mlp.down_proj.bias),
        ):
            copy = packed.get(weight.data_ptr())
            if copy is None:
                return None
            weights.append(copy[0])
            sizes.append(copy[1])
            biases.append(bias)
    return norms, weights, biases, sizes, eps.pop()


def _stream_linear(x, weight, bias, packed: dict[int, tuple[torch.Tensor, int]]) -> torch.Tensor:
    """x @ W.T through the skinny kernel at 1 to skinny.MAX_ROWS rows, else the dense path."""
    p = packed.get(weight.data_ptr())
    if p is not None and x.dim() == 2 and x.shape[0] <= skinny.MAX_ROWS and x.dtype == weight.dtype:
        return skinny.linear(x, p[0], p[1], bias)
    return _linear(x, weight, bias)


def _int8_linear(x: torch.Tensor, packed: tuple, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ dequant(W).T through aten's int8 weight-only kernel (bf16 activations: its float32
    variant was 10-30x slower on this CPU), back in x's dtype."""
    q, scale = packed
    out = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), q, scale).to(x.dtype)
    return out if bias is None else out + bias


def _rms(x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.eps)
    return norm.weight * F.rms_norm(x.float(), (x.shape[-1],), None, norm.eps).to(x.dtype)


def _decode_math(
    model: CausalLM,
    x: torch.Tensor,  # [B, hidden] the new tokens' embeddings
    cos: torch.Tensor,  # [B, 1, D]
    sin: torch.Tensor,
    k_copy: torch.Tensor,  # [L, B, KVH, capacity, D] the KV copy, read only
    v_copy: torch.Tensor,
    mask: torch.Tensor,  # [B, 1, 1, k_old] additive (0 / -inf), k_old > 0 cached positions
    kv_dtype: torch.dtype,  # the pool's dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The compiled step's math: (logits [B, vocab] float32, new keys and values [L, B, KVH,
    D] in the pool's dtype). Each query attends to the copy's cached positions and, apart, to
    its own new key, so nothing is written here; the softmax runs over both at once."""
    cfg = model.config
    batch = x.shape[0]
    heads, kv_heads, dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    group, half, scale = heads // kv_heads, dim // 2, dim**-0.5
    attn_dtype, k_old = k_copy.dtype, mask.shape[-1]
    keys, values = [], []
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        h = _rms(x, layer.input_layernorm)
        qkv = F.linear(h, *attn._fused_qkv).view(batch, heads + 2 * kv_heads, dim)
        qk = qkv[:, : heads + kv_heads]
        rotated = torch.cat((-qk[..., half:], qk[..., :half]), dim=-1)
        qk = qk * cos + rotated * sin  # [B, H + KVH, D]
        k, v = qk[:, heads:].to(kv_dtype), qkv[:, heads + kv_heads :].to(kv_dtype)
        keys.append(k)
        values.append(v)
        k_new, v_new = k.to(attn_dtype)[:, :, None, :], v.to(attn_dtype)[:, :, None, :]
        q = qk[:, :heads].reshape(batch, kv_heads, group, dim).to(attn_dtype) * scale
        cached = torch.matmul(q, k_copy[i, :, :, :k_old].transpose(-1, -2)) + mask
        own = (q * k_new).sum(-1, keepdim=True)  # [B, KVH, G, 1]
        probs = torch.softmax(torch.cat((cached, own), dim=-1), dim=-1)
        out = torch.matmul(probs[..., :k_old], v_copy[i, :, :, :k_old])
        out = (out + probs[..., k_old:] * v_new).to(x.dtype)  # [B, KVH, G, D]
        o = attn.o_proj
        x = x + F.linear(out.reshape(batch, heads * dim), o.weight, o.bias)
        h = _rms(x, layer.post_attention_layernorm)
        gate, up = F.linear(h, *mlp._fused_gate_up).chunk(2, dim=-1)
        down = mlp.down_proj
        x = x + F.linear(F.silu(gate) * up, down.weight, down.bias)
    logits = F.linear(_rms(x, model.model.norm), model.lm_head.weight).float()
    return logits, torch.stack(keys), torch.stack(values)


_compiled_math = None


def _compiled_decode_math(*args):
    """`_decode_math` through `torch.compile`, made on first use. Dynamo keeps a graph per
    model (guarded on its parameters) for batch 1 and one for larger batches; the batch and
    the number of cached positions are dynamic, the model's dimensions static. Past dynamo's
    recompile limit (8 graphs) the math runs uncompiled, with the same results."""
    global _compiled_math
    if _compiled_math is None:
        _compiled_math = torch.compile(_decode_math)
    _, x, cos, sin, k_copy, v_copy, mask, _ = args
    if x.shape[0] > 1:  # a dynamic dimension of size 1 would be specialised anyway
        for tensor in (x, cos, sin, mask):
            torch._dynamo.mark_dynamic(tensor, 0)
        torch._dynamo.mark_dynamic(k_copy, 1)
        torch._dynamo.mark_dynamic(v_copy, 1)
    for tensor in (k_copy, v_copy):
        torch._dynamo.mark_dynamic(tensor, 3)
    if mask.shape[-1] > 1:
        torch._dynamo.mark_dynamic(mask, 3)
    import torch._inductor.config as inductor_config

    # Frozen weights: inductor folds the parameters in as constants (prepacked for oneDNN);
    # dynamo guards on the parameters themselves, so another model compiles its own graph.
    # C++ wrapper: the graph's kernels are called from C++, not from generated Python; on a
    # 2-vCPU Xeon the compiled step went from 1.31x to 1.43x transformers at batch 32 (bench/
    # engine/REPORT.md), for a longer first compile.
    with inductor_config.patch(freezing=True, cpp_wrapper=True):
        return _compiled_math(*args)


_compile_error: str | None = None


def _give_up_compiling(exc: Exception) -> None:
    """A compile that failed (no C++ compiler, an inductor error) fails the same way every
    time: from now on this process runs the eager step (the same tokens), and says so once."""
    global _compile_error
    lines = str(exc).strip().splitlines()
    _compile_error = f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]
    log.warning("decode_compile: torch.compile failed (%s); decode steps run uncompiled",
                _compile_error)  # fmt: skip


class DecodeState:
    """The KV copy of one decode batch (requests in order) and its index tensors."""

    def __init__(self) -> None:
        self.requests: list[object] = []
        self.lengths: list[int] = []  # KV positions of each request after the last step
        self.k: torch.Tensor | None = None  # [L, B, KVH, capacity, D]
        self.v: torch.Tensor | None = None
        self.mask: torch.Tensor | None = None  # [B, 1, 1, capacity] additive (0 / -inf)
        self.positions: torch.Tensor | None = None  # [B] long, position of the next token
        self.rows: torch.Tensor | None = None  # [B] arange
        self.rebuilds = 0

    def invalidate(self) -> None:
        """Forget the batch and free its KV copy (it only lives across consecutive decode
        steps; the next decode step rebuilds it from the pool)."""
        self.requests, self.lengths = [], []
        self.k = self.v = self.mask = None

    def continues(self, requests: Sequence[object], cached_lens: Sequence[int]) -> bool:
        """Whether this step is the next decode step of exactly the last step's requests."""
        return (
            len(requests) == len(self.requests)
            and all(a is b for a, b in zip(requests, self.requests, strict=True))
            and list(cached_lens) == self.lengths
            and self.k is not None
            and max(cached_lens) < self.k.shape[3]
        )

    def rebuild(
        self,
        requests: Sequence[object],
        cached_lens: Sequence[int],
        slot_lists: Sequence[torch.Tensor],  # the pool slots of each request's cached positions
        k_flat: torch.Tensor,  # [L, slots, KVH, D]
        v_flat: torch.Tensor,
    ) -> None:
        layers, _, heads, dim = k_flat.shape
        batch = len(requests)
        need = max(cached_lens) + 1
        capacity = -(-(need + _CAPACITY_STEP) // _CAPACITY_STEP) * _CAPACITY_STEP
        shape = (layers, batch, heads, capacity, dim)
        device, dtype = k_flat.device, k_flat.dtype
        if device.type == "cpu" and dtype != torch.float32:
            # CPU half-precision bmm is slow; the copy holds the pool's rounded values in float32.
            dtype = torch.float32
        if self.k is None or self.k.shape != shape or self.k.dtype != dtype:
            self.k = torch.zeros(shape, dtype=dtype, device=device)
            self.v = torch.zeros(shape, dtype=dtype, device=device)
            self.rows = torch.arange(batch, device=device)
        key_pos = torch.arange(capacity, device=device)
        lens = torch.tensor(list(cached_lens), device=device)
        self.mask = torch.zeros((batch, 1, 1, capacity), dtype=torch.float32, device=device)
        self.mask.masked_fill_((key_pos[None, :] >= lens[:, None])[:, None, None, :], -torch.inf)
        for b, (n, slots) in enumerate(zip(cached_lens, slot_lists, strict=True)):
            if n:
                self.k[:, b, :, :n] = k_flat[:, slots].transpose(1, 2).to(dtype)
                self.v[:, b, :, :n] = v_flat[:, slots].transpose(1, 2).to(dtype)
        self.positions = lens.clone()
        self.requests = list(requests)
        self.lengths = list(cached_lens)
        self.rebuilds += 1

    def advance(self) -> None:
        """After a step: every request holds one more position."""
        self.positions += 1
        self.lengths = [n + 1 for n in self.lengths]


@torch.inference_mode()
def decode_forward(
    model: CausalLM,
    state: DecodeState,
    input_ids: torch.Tensor,  # [B] long, the one new token of each request
    write_slots: torch.Tensor,  # [B] long, its flat pool slot
    k_cache: torch.Tensor,  # [L, num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,
    *,
    int8: bool = False,  # int8 weight-only linears (CPU), see quantize_int8
    packed: bool = False,  # oneDNN-prepacked copies of the weights (CPU), see prepack_weights
    stream: bool = False,  # the skinny kernel's packed copies (CPU), see stream_weights
    one_call: bool = True,  # stream: the decoder layers in one C++ call where they can
    compiled: bool = False,  # through torch.compile (see the module's docstring)
) -> torch.Tensor:  # [B, vocab] float32
    """One decode step over `state`'s requests (their KV copy must hold the cached positions);
    writes the new K/V to the pool and the copy, then advances `state`."""
    cfg = model.config
    first = model.model.layers[0]
    fused = getattr(first.self_attn, "_fused_qkv", None)
    if fused is None or first.self_attn.q_proj.weight.data_ptr() != fused[0].data_ptr():
        fuse_projections(model)  # first use, or the model was cast / moved since
    batch = input_ids.shape[0]
    heads, kv_heads, dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    group = heads // kv_heads
    lengths = [n + 1 for n in state.lengths]  # keys each request attends to, after the write
    k_max = max(lengths)
    assert k_max <= cfg.max_position, f"position beyond max_position {cfg.max_position}"
    x = model.model.embed_tokens(input_ids)  # [B, hidden]
    cos_table, sin_table = rope_table(model, k_max, x.dtype)
    cos, sin = cos_table[state.positions][:, None, :], sin_table[state.positions][:, None, :]
    layers, blocks, block_size, _, _ = k_cache.shape
    k_flat = k_cache.view(layers, blocks * block_size, kv_heads, dim)
    v_flat = v_cache.view(layers, blocks * block_size, kv_heads, dim)
    rows, positions = state.rows, state.positions
    if compiled and not int8 and k_max > 1 and _compile_error is None:
        mask = state.mask[..., : k_max - 1].to(state.k.dtype)
        try:
            logits, k_new, v_new = _compiled_decode_math(
                model, x, cos, sin, state.k, state.v, mask, k_flat.dtype
            )
        except Exception as exc:  # no C++ compiler, or inductor refused the graph
            _give_up_compiling(exc)  # nothing written yet: the eager step below runs instead
            return decode_forward(model, state, input_ids, write_slots, k_cache, v_cache,
                                  int8=int8, packed=packed, stream=stream)  # fmt: skip
        k_flat[:, write_slots] = k_new
        v_flat[:, write_slots] = v_new
        state.k[:, rows, :, positions] = k_new.transpose(0, 1).to(state.k.dtype)
        state.v[:, rows, :, positions] = v_new.transpose(0, 1).to(state.v.dtype)
        state.mask[rows, 0, 0, positions] = 0.0
        state.advance()
        return logits
    state.mask[rows, 0, 0, positions] = 0.0  # the new position is a valid key from now on
    # Equal lengths (the usual steady batch) need no mask at all.
    attn_dtype = state.k.dtype  # float32 on the CPU whatever the model's dtype
    mask = state.mask[..., :k_max].to(attn_dtype) if min(lengths) != k_max else None
    scale = dim**-0.5
    half = dim // 2
    # The engine's C++ kernels (stream, agents/engine/skinny.py) where they run: the linears,
    # the attention (one pass over each request's keys and values, its scores kept in cache),
    # RMSNorm, the rotary embedding and silu(gate) * up, each one call where torch makes several
    # (the same values, see skinny.py).
    kernels = (
        stream
        and x.device.type == "cpu"
        and x.dtype in (torch.float32, torch.bfloat16)
        and skinny.available()
    )
    if int8:
        quantized = quantize_int8(model)

        def linear(x, weight, bias=None):
            return _int8_linear(x, quantized[weight.data_ptr()], bias)
    elif packed and x.device.type == "cpu":
        prepacked = prepack_weights(model)

        def linear(x, weight, bias=None):
            return _packed_linear(x, weight, bias, prepacked)
    elif kernels:
        streamed = stream_weights(model)

        def linear(x, weight, bias=None):
            return _stream_linear(x, weight, bias, streamed)
    else:
        linear = _linear
    attend = kernels and skinny.attention_supported(state.k, dim)
    key_counts = torch.tensor(lengths, dtype=torch.long) if attend else None
    kernel_rope = kernels and dim % 32 == 0

    def norm(x: torch.Tensor, module: RMSNorm) -> torch.Tensor:
        return skinny.rms_norm(x, module.weight, module.eps) if kernels else _rms(x, module)

    # All the decoder layers in one call to the C++ kernels where everything they need runs
    # there (the same kernels and roundings as the loop below, without a Python step per op).
    whole = (
        one_call
        and attend
        and kernel_rope
        and batch <= skinny.MAX_ROWS
        and k_flat.dtype == x.dtype
        and k_flat.is_contiguous()
    )
    layer_args = stream_layers(model) if whole else None
    if layer_args is not None:
        norms, weights, biases, sizes, eps = layer_args
        x = skinny.decode_layers(
            x, norms, weights, biases, sizes, eps, cos.reshape(batch, dim), sin.reshape(batch, dim),
            k_flat, v_flat, write_slots, state.k, state.v, positions, key_counts, heads, kv_heads,
            scale,
        )  # fmt: skip
    else:
        # The new position's rows in the KV copy, flattened ([L * B * KVH * capacity, D], which
        # the copy is, contiguous): one index per (request, KV head) per layer, so each layer
        # writes its new keys and values with one index_copy_ each, not a two-index index_put.
        copy_k, copy_v = state.k.view(-1, dim), state.v.view(-1, dim)
        capacity = state.k.shape[3]
        heads_in_copy = (rows * kv_heads)[:, None] + torch.arange(kv_heads, device=rows.device)
        at_layer0 = (heads_in_copy * capacity + positions[:, None]).reshape(-1)  # [B * KVH]
        layer_stride = batch * kv_heads * capacity
        for i, layer in enumerate(model.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            h = norm(x, layer.input_layernorm)
            qkv = linear(h, *attn._fused_qkv).view(batch, heads + 2 * kv_heads, dim)
            if kernel_rope:
                qk = skinny.rope(qkv, cos, sin, heads + kv_heads)
            else:
                qk = qkv[:, : heads + kv_heads]
                rotated = torch.cat((-qk[..., half:], qk[..., :half]), dim=-1)
                qk = qk * cos + rotated * sin  # [B, H + KVH, D]
            k, v = qk[:, heads:], qkv[:, heads + kv_heads :]
            k, v = k.to(k_flat.dtype), v.to(v_flat.dtype)
            k_flat[i].index_copy_(0, write_slots, k)
            v_flat[i].index_copy_(0, write_slots, v)
            at = at_layer0 + i * layer_stride if i else at_layer0
            copy_k.index_copy_(0, at, k.to(attn_dtype).reshape(-1, dim))
            copy_v.index_copy_(0, at, v.to(attn_dtype).reshape(-1, dim))
            k_all, v_all = state.k[i], state.v[i]  # [B, KVH, capacity, D]
            q = qk[:, :heads].reshape(batch, kv_heads, group, dim).to(attn_dtype) * scale
            if attend:
                out = skinny.attention(q, k_all[:, :, :k_max], v_all[:, :, :k_max], key_counts)
                out = out.to(x.dtype)
            else:
                scores = torch.matmul(q, k_all[:, :, :k_max].transpose(-1, -2))
                if mask is not None:
                    scores = scores + mask  # [B, KVH, G, K]
                probs = torch.softmax(scores, dim=-1)
                out = torch.matmul(probs, v_all[:, :, :k_max]).to(x.dtype)  # [B, KVH, G, D]
            o = attn.o_proj
            x = x + linear(out.reshape(batch, heads * dim), o.weight, o.bias)
            h = norm(x, layer.post_attention_layernorm)
            gate_up = linear(h, *mlp._fused_gate_up)
            if kernels:
                act = skinny.silu_mul(gate_up)
            else:
                gate, up = gate_up.chunk(2, dim=-1)
                act = F.silu(gate) * up
            down = mlp.down_proj
            x = x + linear(act, down.weight, down.bias)
    state.advance()
    return linear(norm(x, model.model.norm), model.lm_head.weight).float()
