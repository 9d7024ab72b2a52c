"""Measure, on one GPU, what the planner's engine constants stand for.

The planner turns tokens into seconds with two efficiencies (``pdd/hardware.py``): prefill
FLOPs over peak compute, and a decode step's bytes (the weights its batch touches plus its KV)
over peak memory bandwidth, plus ``prefill_half_tokens`` for the MoE pass-size effect. Those
constants are calibrated on docs/pdd.md's published figures; this probe measures what one GPU
actually does on the same arithmetic, so the report can say how far the calibrated values sit
from hardware and whether a decode step's time follows its bytes across batch sizes.

What runs: one layer of a DeepSeek-V3-class model (the planner's model: MLA attention, 256
routed experts with 8 per token, one shared expert), sharded as a node of ``ep`` chips serves
it (attention data-parallel, experts split over the chips), on this one chip, with random
bf16 weights and uniform routing. Expert all-to-all and tensor-parallel communication are not
run: the figures are what one chip's kernels reach, an upper bound on the engine's efficiency.

- ceilings: a large bf16 matrix product and a device-to-device copy (the measured peaks);
- prefill MoE: one chip's share of a pass of ``t`` tokens (about t/32 rows per local expert),
  grouped GEMM, efficiency against ``t`` -> fitted ``prefill_half_tokens``;
- prefill MoE in float8 (CUDA only): the same experts quantised row-wise, through
  ``torch._scaled_grouped_mm``, checked against the bf16 result;
- prefill dense: the attention projections and shared expert on the chip's t/ep tokens;
- prefill attention: causal attention over a request of L tokens (128 heads);
- decode step: the whole layer for a node batch ``b`` at context ``ctx`` (weight-absorbed MLA
  over the latent KV, touched experts only), timed as a CUDA graph; its bytes over time give
  the bandwidth efficiency the planner's formula would need at that batch.

``--quick`` runs tiny shapes on the CPU (the test suite uses it); the figures quoted in
``bench/planner/REPORT.md`` come from CUDA runs (``bench/planner/gpu/``); ``--from FILE``
prints an earlier run's table, summaries included, without a GPU.
Needs torch (bench scripts may; the control plane does not).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Shapes:
    hidden: int = 7168
    moe_inter: int = 2048
    experts: int = 256
    topk: int = 8
    ep: int = 8  # chips per node: experts split over them, attention data-parallel
    heads: int = 128
    q_lora: int = 1536
    kv_lora: int = 512
    rope: int = 64
    nope: int = 128
    v_head: int = 128
    shared_inter: int = 2048
    layers: int = 61

    @property
    def local_experts(self) -> int:
        return self.experts // self.ep

    @property
    def latent(self) -> int:
        return self.kv_lora + self.rope


FULL = Shapes()
QUICK = Shapes(
    hidden=128,
    moe_inter=64,
    experts=32,
    topk=4,
    ep=4,
    heads=4,
    q_lora=64,
    kv_lora=32,
    rope=16,
    nope=32,
    v_head=32,
    shared_inter=64,
)


class Timer:
    """Median wall time of a callable: CUDA events on a GPU, perf_counter on the CPU."""

    def __init__(self, device: torch.device, reps: int, warmup: int):
        self.device, self.reps, self.warmup = device, reps, warmup

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __call__(self, fn) -> float:
        for _ in range(self.warmup):
            fn()
        self.sync()
        times = []
        for _ in range(self.reps):
            if self.device.type == "cuda":
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def graphed(self, fn):
        """``fn`` captured as a CUDA graph where possible (no launch gaps); else ``fn``."""
        if self.device.type != "cuda":
            return fn, False
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                fn()
        except RuntimeError:
            return fn, False
        return graph.replay, True


def rand(shape, device, dtype, scale=0.05):
    return (torch.randn(shape, device=device, dtype=torch.float32) * scale).to(dtype)


def check_counts(s: Shapes) -> list[int]:
    """Uneven rows per local expert for checking a grouped kernel against the per-expert loop."""
    return [3 + (e % 5) * 8 for e in range(s.local_experts)]


def local_counts(tokens: int, s: Shapes, device, generator) -> torch.Tensor:
    """Rows each of this chip's experts receives from ``tokens`` uniformly routed tokens."""
    picks = torch.rand(tokens, s.experts, generator=generator).topk(s.topk, dim=1).indices
    mine = picks[picks < s.local_experts]
    return torch.bincount(mine, minlength=s.local_experts).to(device)


class Experts:
    """This chip's routed experts: gate+up fused (E, 2N, H) and down (E, H, N), bf16."""

    def __init__(self, s: Shapes, device, dtype):
        self.s = s
        self.w13 = rand((s.local_experts, 2 * s.moe_inter, s.hidden), device, dtype)
        self.w2 = rand((s.local_experts, s.hidden, s.moe_inter), device, dtype)
        self.grouped_ok = self._check_grouped(device, dtype)

    def bytes_per_expert(self) -> int:
        return (self.w13[0].numel() + self.w2[0].numel()) * self.w13.element_size()

    def flops(self, rows: int) -> float:
        return 2.0 * rows * self.s.hidden * 3 * self.s.moe_inter

    def loop(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        out = torch.empty_like(x)
        start = 0
        n = self.s.moe_inter
        for e, c in enumerate(counts):
            if not c:
                continue
            h = x[start : start + c] @ self.w13[e].t()
            out[start : start + c] = (F.silu(h[:, :n]) * h[:, n:]) @ self.w2[e].t()
            start += c
        return out

    def grouped(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        n = self.s.moe_inter
        h = torch._grouped_mm(x, self.w13.transpose(1, 2), offs=offs)
        return torch._grouped_mm(F.silu(h[:, :n]) * h[:, n:], self.w2.transpose(1, 2), offs=offs)

    def _check_grouped(self, device, dtype) -> str | None:
        """None when torch._grouped_mm runs here and agrees with the per-expert loop."""
        if not hasattr(torch, "_grouped_mm"):
            return "torch._grouped_mm missing"
        counts = check_counts(self.s)
        x = rand((sum(counts), self.s.hidden), device, dtype, scale=1.0)
        offs = torch.tensor(counts, device=device).cumsum(0).to(torch.int32)
        try:
            got = self.grouped(x, offs).float()
        except (RuntimeError, NotImplementedError) as exc:
            return f"torch._grouped_mm unavailable: {str(exc).splitlines()[0][:120]}"
        ref = self.loop(x, counts).float()
        err = ((got - ref).norm() / ref.norm()).item()
        return None if err < 2e-2 else f"torch._grouped_mm disagrees with the loop (rel {err:.2e})"


FP8_MAX = 448.0  # largest float8_e4m3fn
FP8_CHECK = 0.1  # relative error against bf16 that float8 with row-wise scales stays under


def to_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float8 (e4m3) with one scale per row (per last-dimension vector, at any rank):
    x ~= q * scale[..., None]."""
    scale = x.abs().amax(dim=-1).float().clamp(min=1e-12) / FP8_MAX
    q = (x.float() / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


class Fp8Experts:
    """The same experts in float8 with per-channel scales, as DeepSeek-V3 serves them (its
    weights are block-scaled; row-wise scales here), through ``torch._scaled_grouped_mm``."""

    def __init__(self, experts: Experts):
        self.s = experts.s
        self.w13, self.s13 = to_fp8_rows(experts.w13)  # (E, 2N, H), (E, 2N)
        self.w2, self.s2 = to_fp8_rows(experts.w2)  # (E, H, N), (E, H)

    def forward(self, x8: torch.Tensor, sx: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """Both expert GEMMs and the activation's re-quantization between them."""
        n = self.s.moe_inter
        h = torch._scaled_grouped_mm(
            x8, self.w13.transpose(1, 2), sx, self.s13, offs=offs,
            out_dtype=torch.bfloat16, use_fast_accum=True,
        )  # fmt: skip
        a8, sa = to_fp8_rows(F.silu(h[:, :n]) * h[:, n:])
        return torch._scaled_grouped_mm(
            a8, self.w2.transpose(1, 2), sa, self.s2, offs=offs,
            out_dtype=torch.bfloat16, use_fast_accum=True,
        )  # fmt: skip


def padded_offsets(counts: list[int], multiple: int, device) -> tuple[list[int], torch.Tensor]:
    """Each group's rows rounded up to ``multiple`` (the FP8 grouped kernel's alignment)."""
    padded = [-(-c // multiple) * multiple for c in counts]
    return padded, torch.tensor(padded, device=device).cumsum(0).to(torch.int32)


def measure_prefill_moe_fp8(timer, s, experts, device, tokens_list, gen) -> dict:
    """The routed experts in float8 against tokens per pass (CUDA, SM90+ only)."""
    if device.type != "cuda":
        return {"skipped": "float8 grouped GEMM needs CUDA"}
    try:
        n = 8192
        a8, sa = to_fp8_rows(torch.randn(n, n, device=device))
        b8, sb = to_fp8_rows(torch.randn(n, n, device=device))
        sec = timer(
            partial(torch._scaled_mm, a8, b8.t(), sa[:, None], sb[None, :],
                    out_dtype=torch.bfloat16, use_fast_accum=True)
        )  # fmt: skip
        peak = 2 * n**3 / sec / 1e12
        fp8 = Fp8Experts(experts)
        # correctness against the bf16 experts on a small routed batch
        counts = check_counts(s)
        padded, offs = padded_offsets(counts, 16, device)
        x = rand((sum(counts), s.hidden), device, torch.bfloat16, 1.0)
        xp = torch.zeros(sum(padded), s.hidden, device=device, dtype=torch.bfloat16)
        src = dst = 0
        for c, pc in zip(counts, padded, strict=True):
            xp[dst : dst + c] = x[src : src + c]
            src, dst = src + c, dst + pc
        x8, sx = to_fp8_rows(xp)
        got = fp8.forward(x8, sx, offs).float()
        ref = experts.loop(x, counts).float()
        starts = [0, *itertools.accumulate(padded)][:-1]
        keep = torch.cat([torch.arange(o, o + c) for o, c in zip(starts, counts, strict=True)])
        err = ((got[keep.to(device)] - ref).norm() / ref.norm()).item()
        if not err < FP8_CHECK:  # NaN fails too
            return {"skipped": f"float8 experts disagree with bf16 (rel {err:.2e})"}
        rows_out = []
        for t in tokens_list:
            counts = local_counts(t, s, device, gen).tolist()
            padded, offs = padded_offsets(counts, 16, device)
            x8, sx = to_fp8_rows(rand((sum(padded), s.hidden), device, torch.bfloat16, 1.0))
            sec = timer(partial(fp8.forward, x8, sx, offs))
            flops = experts.flops(sum(counts))
            rows_out.append(
                {"tokens_per_pass": t, "rows": sum(counts), "padded_rows": sum(padded), "s": sec,
                 "tflops": flops / sec / 1e12, "efficiency": flops / sec / 1e12 / peak}
            )  # fmt: skip
    except (RuntimeError, AttributeError, TypeError, ValueError) as exc:
        return {"skipped": f"float8 path unavailable: {str(exc).splitlines()[0][:160]}"}
    fit = fit_half_tokens([(r["tokens_per_pass"], r["efficiency"]) for r in rows_out])
    return {"fp8_gemm_tflops": peak, "check_rel_error": err, "rows": rows_out, "fit": fit}


def measure_ceilings(timer: Timer, device, dtype, quick: bool) -> dict:
    n = 512 if quick else 8192
    a, b = rand((n, n), device, dtype, 1.0), rand((n, n), device, dtype, 1.0)
    gemm_s = timer(lambda: a @ b)
    elems = (1 << 20) if quick else (1 << 31)  # 4 GiB of bf16 on a GPU
    src = torch.empty(elems, device=device, dtype=dtype).normal_()
    dst = torch.empty_like(src)
    copy_s = timer(lambda: dst.copy_(src))
    moved = 2 * elems * src.element_size()
    return {
        "gemm_n": n,
        "gemm_tflops": 2 * n**3 / gemm_s / 1e12,
        "copy_bytes": moved,
        "copy_tbps": moved / copy_s / 1e12,
    }


def measure_prefill_moe(timer, s, experts, device, dtype, tokens_list, gen, peak) -> list[dict]:
    rows_out = []
    for t in tokens_list:
        counts = local_counts(t, s, device, gen)
        rows = int(counts.sum())
        x = rand((rows, s.hidden), device, dtype, 1.0)
        cl = counts.tolist()
        row = {"tokens_per_pass": t, "rows": rows, "rows_per_expert": rows / s.local_experts}
        flops = experts.flops(rows)
        if experts.grouped_ok is None:
            offs = counts.cumsum(0).to(torch.int32)
            sec = timer(partial(experts.grouped, x, offs))
            row.update(grouped_s=sec, grouped_tflops=flops / sec / 1e12)
        sec = timer(partial(experts.loop, x, cl))
        row.update(loop_s=sec, loop_tflops=flops / sec / 1e12)
        best = max(row.get("grouped_tflops", 0.0), row["loop_tflops"])
        row["efficiency"] = best / peak
        rows_out.append(row)
    return rows_out


def linears(weights: list[torch.Tensor], inputs: list[torch.Tensor]) -> None:
    for w, x in zip(weights, inputs, strict=True):
        F.linear(x, w)


def prefill_dense_weights(s: Shapes) -> list[tuple[int, int]]:
    """(in, out) of the per-token dense matrices in a prefill pass (MLA not absorbed)."""
    return [
        (s.hidden, s.q_lora),
        (s.q_lora, s.heads * (s.nope + s.rope)),
        (s.hidden, s.kv_lora + s.rope),
        (s.kv_lora, s.heads * (s.nope + s.v_head)),
        (s.heads * s.v_head, s.hidden),
        (s.hidden, 2 * s.shared_inter),
        (s.shared_inter, s.hidden),
    ]


def measure_prefill_dense(timer, s, device, dtype, tokens_list, peak) -> list[dict]:
    mats = [(rand((o, i), device, dtype), i, o) for i, o in prefill_dense_weights(s)]
    out = []
    for t in tokens_list:
        r = max(t // s.ep, 1)
        inputs = [rand((r, i), device, dtype, 1.0) for _, i, _ in mats]

        sec = timer(partial(linears, [w for w, _, _ in mats], inputs))
        flops = sum(2.0 * r * i * o for _, i, o in mats)
        out.append(
            {
                "tokens_per_pass": t,
                "rows": r,
                "s": sec,
                "tflops": flops / sec / 1e12,
                "efficiency": flops / sec / 1e12 / peak,
            }
        )
    return out


def measure_prefill_attention(timer, s, device, dtype, lengths, peak) -> list[dict]:
    out = []
    dqk = s.nope + s.rope
    for n in lengths:
        q = rand((1, s.heads, n, dqk), device, dtype, 1.0)
        k = rand((1, s.heads, n, dqk), device, dtype, 1.0)
        v = rand((1, s.heads, n, s.v_head), device, dtype, 1.0)
        try:
            sec = timer(partial(F.scaled_dot_product_attention, q, k, v, is_causal=True))
        except RuntimeError as exc:
            out.append({"tokens": n, "error": str(exc).splitlines()[0][:160]})
            continue
        flops = 2.0 * s.heads * n * n / 2 * (dqk + s.v_head)
        out.append(
            {
                "tokens": n,
                "s": sec,
                "tflops": flops / sec / 1e12,
                "efficiency": flops / sec / 1e12 / peak,
            }
        )
    return out


class DecodeLayer:
    """One layer's decode step on one chip: MLA weight-absorbed over the latent KV."""

    def __init__(self, s: Shapes, experts: Experts, device, dtype):
        self.s, self.experts, self.device, self.dtype = s, experts, device, dtype
        self.w_qa = rand((s.q_lora, s.hidden), device, dtype)
        self.w_qb = rand((s.heads * (s.nope + s.rope), s.q_lora), device, dtype)
        self.w_kva = rand((s.latent, s.hidden), device, dtype)
        self.w_uk = rand((s.heads, s.nope, s.kv_lora), device, dtype)  # absorbed into q
        self.w_uv = rand((s.heads, s.kv_lora, s.v_head), device, dtype)  # absorbed into out
        self.w_o = rand((s.hidden, s.heads * s.v_head), device, dtype)
        self.w_sh13 = rand((2 * s.shared_inter, s.hidden), device, dtype)
        self.w_sh2 = rand((s.hidden, s.shared_inter), device, dtype)

    def dense_weight_bytes(self) -> int:
        ws = (
            self.w_qa,
            self.w_qb,
            self.w_kva,
            self.w_uk,
            self.w_uv,
            self.w_o,
            self.w_sh13,
            self.w_sh2,
        )
        return sum(w.numel() * w.element_size() for w in ws)

    def attention(self, x, kv, kernel: str = "bmm", tokens: int = 1):
        """The attention half of the step for ``kv.shape[0]`` requests, ``tokens`` new tokens
        each (1 in decode; more in an extend step, whose tokens all attend to the whole cached
        context: the causal mask among them is left out). ``kernel``: "bmm" (two batched GEMMs
        around a softmax, the scores round-trip through memory) or "sdpa" (torch's fused
        attention, the heads as queries against the one latent KV, as FlashMLA does)."""
        s = self.s
        bc = kv.shape[0]
        q = F.linear(F.linear(x, self.w_qa), self.w_qb).view(bc, tokens, s.heads, s.nope + s.rope)
        F.linear(x, self.w_kva)  # the new tokens' latents (their cache write is not timed)
        q_lat = torch.einsum("bthn,hnc->bthc", q[..., : s.nope], self.w_uk)
        q_full = torch.cat([q_lat, q[..., s.nope :]], dim=-1).view(bc, tokens * s.heads, s.latent)
        scale = 1.0 / math.sqrt(s.nope + s.rope)
        if kernel == "sdpa":
            ctx = F.scaled_dot_product_attention(
                q_full.unsqueeze(1),
                kv.unsqueeze(1),
                kv[..., : s.kv_lora].unsqueeze(1),
                scale=scale,
            ).squeeze(1)
        else:
            scores = torch.bmm(q_full, kv.transpose(1, 2))
            probs = torch.softmax(scores * scale, dim=-1)
            ctx = torch.bmm(probs, kv[..., : s.kv_lora])  # (bc, tokens * heads, kv_lora)
        ctx = ctx.view(bc, tokens, s.heads, s.kv_lora)
        o = torch.einsum("bthc,hcv->bthv", ctx, self.w_uv).reshape(bc * tokens, -1)
        return F.linear(o, self.w_o)

    def step(self, x, kv, kernel: str, xe, counts: list[int]):
        """The whole layer: attention, shared expert, this chip's touched routed experts."""
        self.attention(x, kv, kernel)
        self.shared(x)
        if any(counts):
            self.experts.loop(xe, counts)

    def extend_step(self, x, kv, x_ext, kv_ext, x_all, kernel: str, xe, counts: list[int]):
        """A decode step in which one request brings ``x_ext.shape[0]`` tokens (the extend
        pass of the RLD-to-MD handoff: MD recomputes the KV of the tokens RLD made)."""
        if kv.shape[0]:
            self.attention(x, kv, kernel)
        self.attention(x_ext, kv_ext, kernel, tokens=x_ext.shape[0])
        self.shared(x_all)
        if any(counts):
            self.experts.loop(xe, counts)

    def shared(self, x):
        n = self.s.shared_inter
        h = F.linear(x, self.w_sh13)
        return F.linear(F.silu(h[:, :n]) * h[:, n:], self.w_sh2)


def measure_decode(timer, s, layer, device, dtype, batches, contexts, gen, bw, peak) -> list[dict]:
    out = []
    ex = layer.experts
    for ctx in contexts:
        for b in batches:
            bc = max(b // s.ep, 1)  # requests whose attention runs on this chip
            counts = local_counts(b, s, device, gen)  # the node batch's tokens on my experts
            cl = counts.tolist()
            touched = sum(1 for c in cl if c)
            x = rand((bc, s.hidden), device, dtype, 1.0)
            kv = rand((bc, ctx, s.latent), device, dtype, 1.0)
            xe = rand((max(int(counts.sum()), 1), s.hidden), device, dtype, 1.0)

            attn = {}
            for kernel in ("bmm", "sdpa"):
                try:
                    fn, _ = timer.graphed(partial(layer.attention, x, kv, kernel))
                    attn[kernel] = timer(fn)
                except RuntimeError as exc:  # no fused kernel for this shape: bmm stands
                    attn[kernel + "_error"] = str(exc).splitlines()[0][:160]
            kernel = min(("bmm", "sdpa"), key=lambda k: attn.get(k, math.inf))
            attn_s = attn[kernel]

            run, graphed = timer.graphed(partial(layer.step, x, kv, kernel, xe, cl))
            sec = timer(run)
            if touched:
                moe_run, _ = timer.graphed(partial(ex.loop, xe, cl))
                moe_s = timer(moe_run)
            else:
                moe_s = 0.0
            kv_bytes = bc * ctx * s.latent * kv.element_size()
            w_bytes = layer.dense_weight_bytes() + touched * ex.bytes_per_expert()
            attn_flops = 2.0 * bc * s.heads * ctx * (s.latent + s.kv_lora)
            out.append(
                {
                    "node_batch": b,
                    "chip_requests": bc,
                    "ctx": ctx,
                    "experts_touched": touched,
                    "graph": graphed,
                    "step_s": sec,
                    "attention_s": attn_s,
                    "attention_kernel": kernel,
                    "attention_variants": attn,
                    "moe_s": moe_s,
                    "weight_bytes": w_bytes,
                    "kv_bytes": kv_bytes,
                    "bw_efficiency": (w_bytes + kv_bytes) / sec / (bw * 1e12),
                    "attention_tflops": attn_flops / attn_s / 1e12,
                    # the larger of its FLOPs at peak and its KV bytes at bandwidth
                    "attention_floor_s": max(attn_flops / (peak * 1e12), kv_bytes / (bw * 1e12)),
                    "attention_compute_bound": attn_flops / (peak * 1e12) > kv_bytes / (bw * 1e12),
                    "attention_compute_share": attn_flops / attn_s / 1e12 / peak,
                    "node_step_ms_61_layers": sec * s.layers * 1e3,
                }
            )
    return out


EXTEND_TOKENS = 100  # docs/pdd.md: recomputing 100 tokens' KV took ~one decode step (305 ms)


def measure_extend(timer, s, layer, device, dtype, batches, contexts, gen, kernel) -> list[dict]:
    """A decode step against the same step with one request extending by 100 tokens."""
    out = []
    n = EXTEND_TOKENS
    for ctx in contexts:
        for b in batches:
            bc = max(b // s.ep, 1)
            kv = rand((bc, ctx, s.latent), device, dtype, 1.0)
            x = rand((bc, s.hidden), device, dtype, 1.0)
            counts = local_counts(b, s, device, gen).tolist()
            xe = rand((max(sum(counts), 1), s.hidden), device, dtype, 1.0)
            plain, _ = timer.graphed(partial(layer.step, x, kv, kernel, xe, counts))
            decode_s = timer(plain)
            ext_counts = local_counts(b - 1 + n, s, device, gen).tolist()
            xe_ext = rand((max(sum(ext_counts), 1), s.hidden), device, dtype, 1.0)
            x_ext = rand((n, s.hidden), device, dtype, 1.0)
            x_all = rand((bc - 1 + n, s.hidden), device, dtype, 1.0)
            run, _ = timer.graphed(
                partial(layer.extend_step, x[: bc - 1], kv[: bc - 1], x_ext, kv[bc - 1 :],
                        x_all, kernel, xe_ext, ext_counts)
            )  # fmt: skip
            extend_s = timer(run)
            out.append(
                {"ctx": ctx, "node_batch": b, "extend_tokens": n, "decode_step_s": decode_s,
                 "extend_step_s": extend_s, "steps": extend_s / decode_s}
            )  # fmt: skip
    return out


def combine_linear(moe: list[dict], dense: list[dict], peak: float) -> list[dict]:
    """A pass's matrix work on one chip (routed experts + dense), efficiency against ``t``.

    This is what the planner's ``prefill_efficiency(t)`` scales: attention over the context is
    separate (its cost grows with the context, not with the pass).
    """
    out = []
    for m, d in zip(moe, dense, strict=True):
        moe_s = min(m.get("grouped_s", math.inf), m["loop_s"])
        flops = m["efficiency"] * peak * 1e12 * moe_s + d["efficiency"] * peak * 1e12 * d["s"]
        sec = moe_s + d["s"]
        out.append(
            {
                "tokens_per_pass": m["tokens_per_pass"],
                "s": sec,
                "moe_flop_share": m["efficiency"] * moe_s / (flops / peak / 1e12),
                "efficiency": flops / sec / 1e12 / peak,
            }
        )
    return out


def fit_half_tokens(points: list[tuple[int, float]]) -> dict:
    """Fit eff(t) = e_inf * t / (t + h) (the planner's prefill_half_tokens form).

    A grid on h, least squares on relative error (small passes matter as much as large ones).
    """
    best = None
    for h in [2**k * m for k in range(6, 17) for m in (1.0, 1.25, 1.5, 1.75)]:
        xs = [t / (t + h) / e for t, e in points]  # model / measured, per unit e_inf
        e_inf = sum(xs) / sum(x * x for x in xs)  # minimises sum (e_inf * x - 1)^2
        err = sum((e_inf * x - 1) ** 2 for x in xs)
        if best is None or err < best[0]:
            best = (err, h, e_inf)
    _, h, e_inf = best
    worst = max(abs(e_inf * t / (t + h) - e) / e for t, e in points)
    return {"half_tokens": h, "e_inf": e_inf, "worst_rel_error": worst}


def planner_curve(t: int, half: int, full: int = 16384) -> float:
    """The planner's pass efficiency at ``t`` relative to a full ``full``-token pass."""
    return (full + half) / full * t / (t + half)


def table(result: dict) -> str:
    """The run's figures as text; sections a run left out (``--only``) are left out here."""
    c = result["ceilings"]
    lines = [
        f"device {result['device']} ({result['dtype']}): GEMM {c['gemm_tflops']:.3g} TFLOP/s, "
        f"copy {c['copy_tbps']:.2f} TB/s (read + write)"
    ]
    if "prefill_moe" in result:
        lines += prefill_table(result)
    if "decode" in result:
        lines += decode_table(result)
    if result.get("extend"):
        lines.append(
            f"extend of {result['extend'][0]['extend_tokens']} tokens in a decode step "
            "(the handoff's recompute):  ctx  node-batch  decode ms  with extend ms  = steps"
        )
        for r in result["extend"]:
            lines.append(
                f"  {r['ctx']:>6} {r['node_batch']:>5}  {r['decode_step_s'] * 1e3:>8.3f}"
                f"  {r['extend_step_s'] * 1e3:>8.3f}  {r['steps']:>6.2f}"
            )
    return "\n".join(lines)


def prefill_table(result: dict) -> list[str]:
    lines = ["prefill MoE (one chip's experts):  tokens/pass  rows/expert  TFLOP/s  eff"]
    for r in result["prefill_moe"]:
        tf = max(r.get("grouped_tflops", 0.0), r["loop_tflops"])
        lines.append(
            f"  {r['tokens_per_pass']:>8}  {r['rows_per_expert']:>9.1f}  {tf:>8.1f}  "
            f"{r['efficiency']:.2f}"
        )
    lines.append("prefill dense (t/ep rows):  tokens/pass  TFLOP/s  eff")
    for r in result["prefill_dense"]:
        lines.append(f"  {r['tokens_per_pass']:>8}  {r['tflops']:>8.1f}  {r['efficiency']:.2f}")
    lines.append(
        "prefill matrix work (experts + dense):  tokens/pass  eff  eff/eff(16K)"
        "  planner h=4096  fitted h"
    )
    fit = result["prefill_linear_fit"]
    by_t = {r["tokens_per_pass"]: r["efficiency"] for r in result["prefill_linear"]}
    ref = by_t.get(16384) or max(by_t.values())
    for t, e in by_t.items():
        lines.append(
            f"  {t:>8}  {e:.2f}  {e / ref:>6.2f}  {planner_curve(t, 4096):>6.2f}"
            f"  {planner_curve(t, int(fit['half_tokens'])):>6.2f}"
        )
    lines.append(
        f"  fit eff = {fit['e_inf']:.2f} t/(t+h): h = {fit['half_tokens']:.0f} tokens per pass "
        f"(worst {fit['worst_rel_error']:.0%})"
    )
    moe_fit = result.get("prefill_moe_fit")
    fp8 = result.get("prefill_moe_fp8")
    if moe_fit and fp8:
        lines.append(
            f"routed experts alone, bf16: half point {moe_fit['half_tokens']:.0f} tokens per pass"
            f" (worst {moe_fit['worst_rel_error']:.0%})"
        )
        if "skipped" in fp8:
            lines.append(f"routed experts in float8: {fp8['skipped']}")
        else:
            lines.append(
                f"routed experts in float8 (GEMM peak {fp8['fp8_gemm_tflops']:.0f} TFLOP/s, "
                f"check vs bf16 {fp8['check_rel_error']:.1e}):  tokens/pass  TFLOP/s  eff"
                "  eff/eff(16K)"
            )
            ref = next((r["efficiency"] for r in fp8["rows"] if r["tokens_per_pass"] == 16384),
                       max(r["efficiency"] for r in fp8["rows"]))  # fmt: skip
            for r in fp8["rows"]:
                lines.append(
                    f"  {r['tokens_per_pass']:>8}  {r['tflops']:>8.1f}  {r['efficiency']:.2f}"
                    f"  {r['efficiency'] / ref:>6.2f}"
                )
            f = fp8["fit"]
            lines.append(
                f"  fit: half point {f['half_tokens']:.0f} tokens per pass "
                f"(worst {f['worst_rel_error']:.0%})"
            )
    lines.append("prefill attention (causal, one request):  tokens  TFLOP/s  eff")
    for r in result["prefill_attention"]:
        if "error" in r:
            lines.append(f"  {r['tokens']:>8}  error: {r['error']}")
        else:
            lines.append(f"  {r['tokens']:>8}  {r['tflops']:>8.1f}  {r['efficiency']:.2f}")
    return lines


def decode_table(result: dict) -> list[str]:
    lines = [
        "decode step (one layer, one chip):  ctx  node-batch  experts  step ms  attn ms (kernel)"
        "  moe ms  bw-eff  x61 ms"
    ]
    for r in result["decode"]:
        lines.append(
            f"  {r['ctx']:>6} {r['node_batch']:>5} {r['experts_touched']:>4}  "
            f"{r['step_s'] * 1e3:>7.3f}  {r['attention_s'] * 1e3:>7.3f} ({r['attention_kernel']})"
            f"  {r['moe_s'] * 1e3:>6.3f}"
            f"  {r['bw_efficiency']:.2f}  {r['node_step_ms_61_layers']:>6.1f}"
        )
    return lines + decode_summary(result)


def fused_attention_only(device):
    """On a GPU, forbid SDPA's math fallback (it would materialise L x L scores)."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(
        [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    )


def decode_summary(result: dict) -> list[str]:
    """What the decode rows say about the planner's bytes-over-bandwidth step formula."""
    s = Shapes(**result["shapes"])
    bw = result["peaks_used"]["read_tbps"] * 1e12
    expert_bytes = 3 * s.hidden * s.moe_inter * (2 if "bfloat16" in result["dtype"] else 4)
    lines = ["decode, per row: routed-expert streaming and attention as shares of the copy rate"]
    for r in result["decode"]:
        moe = r["experts_touched"] * expert_bytes / r["moe_s"] / bw if r["moe_s"] else 0.0
        attn = r["kv_bytes"] / r["attention_s"] / bw
        lines.append(
            f"  ctx {r['ctx']:>6} batch {r['node_batch']:>4}: experts {moe:.2f}, "
            f"attention KV {attn:.2f} (floor {r['attention_floor_s'] * 1e3:.3f} ms, "
            f"{'compute' if r['attention_compute_bound'] else 'bytes'}-bound)"
        )
    lines.append("decode, a heavy batch against a light one: step-time ratio / bytes ratio")
    by = {(r["ctx"], r["node_batch"]): r for r in result["decode"]}
    batches = sorted({r["node_batch"] for r in result["decode"]})
    light, heavy = (batches[1], batches[-2]) if len(batches) > 3 else (batches[0], batches[-1])
    for ctx in sorted({r["ctx"] for r in result["decode"]}):
        lo, hi = by[(ctx, light)], by[(ctx, heavy)]
        t_ratio = hi["step_s"] / lo["step_s"]
        b_ratio = (hi["weight_bytes"] + hi["kv_bytes"]) / (lo["weight_bytes"] + lo["kv_bytes"])
        lines.append(
            f"  ctx {ctx:>6}: batch {heavy} / batch {light}: time x{t_ratio:.2f}, "
            f"bytes x{b_ratio:.2f} -> cost grows {t_ratio / b_ratio:.2f}x faster than bytes"
        )
    return lines


def run(
    quick: bool, device_name: str | None, reps: int, seed: int, only: str | None = None
) -> dict:
    if device_name:
        device = torch.device(device_name)
    else:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_probe: --device cuda asked for but torch sees no GPU")
    if device.type != "cuda" and not quick:
        raise SystemExit("gpu_probe: full shapes need a GPU; use --quick on the CPU")
    s = QUICK if quick else FULL
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    timer = Timer(device, reps=reps, warmup=2 if quick else 5)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    result: dict = {
        "device": name,
        "torch": torch.__version__,
        "shapes": asdict(s),
        "dtype": str(dtype),
        "quick": quick,
    }
    result["ceilings"] = measure_ceilings(timer, device, dtype, quick)
    peak = result["ceilings"]["gemm_tflops"]
    bw = result["ceilings"]["copy_tbps"]  # bytes through memory per second, reads + writes
    result["peaks_used"] = {"tflops": peak, "read_tbps": bw}
    experts = Experts(s, device, dtype)
    batches = [4, 16] if quick else [8, 16, 32, 64, 128, 256]
    contexts = [64, 256] if quick else [4096, 16384, 65536]
    extend_at = ([16], [256]) if quick else ([16, 128], [16384, 65536])
    if only == "extend":  # the handoff's recompute alone, with the faster decode attention
        layer = DecodeLayer(s, experts, device, dtype)
        result["extend"] = measure_extend(timer, s, layer, device, dtype, *extend_at, gen, "bmm")
        return result
    result["grouped_mm"] = experts.grouped_ok or "ok"
    tokens = [256, 512] if quick else [512, 1024, 2048, 4096, 8192, 16384, 32768]
    result["prefill_moe"] = measure_prefill_moe(timer, s, experts, device, dtype, tokens, gen, peak)
    result["prefill_dense"] = measure_prefill_dense(timer, s, device, dtype, tokens, peak)
    result["prefill_linear"] = combine_linear(result["prefill_moe"], result["prefill_dense"], peak)
    result["prefill_linear_fit"] = fit_half_tokens(
        [(r["tokens_per_pass"], r["efficiency"]) for r in result["prefill_linear"]]
    )
    result["prefill_moe_fit"] = fit_half_tokens(
        [(r["tokens_per_pass"], r["efficiency"]) for r in result["prefill_moe"]]
    )
    result["prefill_moe_fp8"] = measure_prefill_moe_fp8(timer, s, experts, device, tokens, gen)
    lengths = [128, 256] if quick else [1024, 4096, 16384]
    layer = DecodeLayer(s, experts, device, dtype)
    with fused_attention_only(device):
        result["prefill_attention"] = measure_prefill_attention(
            timer, s, device, dtype, lengths, peak
        )
        result["decode"] = measure_decode(
            timer, s, layer, device, dtype, batches, contexts, gen, bw, peak
        )
        kernel = "bmm" if quick else min(
            ("bmm", "sdpa"), key=lambda k: sum(r["attention_variants"].get(k, math.inf)
                                               for r in result["decode"])
        )  # fmt: skip
        result["extend"] = measure_extend(timer, s, layer, device, dtype, *extend_at, gen, kernel)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes (runs on the CPU)")
    ap.add_argument("--device", help="cuda or cpu (default: cuda when torch sees one)")
    ap.add_argument("--reps", type=int, default=20, help="timed repetitions (median)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", type=Path, help="write the JSON here")
    ap.add_argument("--only", choices=["extend"], help="run the ceilings and this section alone")
    ap.add_argument(
        "--from", dest="source", type=Path, help="print the table of an earlier run's JSON"
    )
    args = ap.parse_args(argv)
    if args.reps < 1:
        ap.error("--reps: must be >= 1")
    if args.source:
        try:
            result = json.loads(args.source.read_text())
            text = table(result)
        except (OSError, ValueError, KeyError) as exc:
            raise SystemExit(f"gpu_probe: --from {args.source}: {exc}") from None
        print(text)
        return 0
    result = run(args.quick, args.device, args.reps, args.seed, args.only)
    text = table(result)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        args.out.with_suffix(".txt").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
