"""Llama-family decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU) whose forward runs k new
positions per request on top of that request's KV in the paged pool; Qwen2 adds q/k/v biases."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from agents.engine.batch import ForwardBatch
from agents.engine.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 as HF does, so half-precision runs match it.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2], with Llama 3 frequency scaling when configured."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.long).float() / dim))
    scaling = cfg.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type")) != "llama3":
        return inv_freq
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(is_medium, smoothed, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x: [T, heads, D]; cos, sin: [T, 1, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, q_size, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv_size, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=cfg.attention_out_bias)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, 1, D]
        sin: torch.Tensor,  # [T, 1, D]
        batch: ForwardBatch,
        k_cache: torch.Tensor,  # [num_blocks * block_size, KVH, D], this layer's pool slice
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        tokens = x.shape[0]
        q = apply_rope(self.q_proj(x).view(tokens, self.num_heads, self.head_dim), cos, sin)
        k = apply_rope(self.k_proj(x).view(tokens, self.num_kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        # Write first, then read: the new positions attend to themselves through the pool.
        k_cache[batch.write_slots] = k.to(k_cache.dtype)
        v_cache[batch.write_slots] = v.to(v_cache.dtype)
        keys = k_cache[batch.read_slots].to(q.dtype).transpose(1, 2)  # [B, KVH, K, D]
        values = v_cache[batch.read_slots].to(q.dtype).transpose(1, 2)  # [B, KVH, K, D]
        queries = q[batch.query_index].transpose(1, 2)  # [B, H, Q, D]
        out = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=batch.attn_mask, enable_gqa=True
        )  # [B, H, Q, D]
        out = out.transpose(1, 2)[batch.token_seq, batch.token_row]  # [T, H, D]
        return self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, batch, k_cache, v_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderStack(nn.Module):
    """Embeddings, layers and final norm; parameter names follow Hugging Face's `model.*`."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """The whole decoder with its LM head; `forward` reads and writes the paged KV pool."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderStack(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    @torch.inference_mode()
    def forward(
        self,
        batch: ForwardBatch,
        k_cache: torch.Tensor,  # [L, num_blocks, block_size, KVH, D]
        v_cache: torch.Tensor,
        logits_index: torch.Tensor | None = None,  # [n] rows of T to score; None = all
    ) -> torch.Tensor:  # [n, vocab] float32
        assert batch.positions.numel() == 0 or int(batch.positions.max()) < (
            self.config.max_position
        ), f"position beyond max_position {self.config.max_position}"
        x = self.model.embed_tokens(batch.input_ids)  # [T, hidden]
        freqs = batch.positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, D]
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        layers, blocks, block_size, heads, dim = k_cache.shape
        k_flat = k_cache.view(layers, blocks * block_size, heads, dim)
        v_flat = v_cache.view(layers, blocks * block_size, heads, dim)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, batch, k_flat[i], v_flat[i])
        if logits_index is not None:
            x = x[logits_index]
        return self.lm_head(self.model.norm(x)).float()
