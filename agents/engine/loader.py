"""Builds the default model `baton-tiny` from a fixed seed and loads Hugging Face-layout Llama /
Qwen2 checkpoints from a local folder; `load_model(spec)` picks between them."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, NamedTuple

import torch

from agents.engine.config import ModelConfig
from agents.engine.model import CausalLM, rope_inv_freq
from pdd.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

BATON_TINY = "baton-tiny"
# A gain above 1 keeps greedy decoding from settling into short loops; see build_baton_tiny.
INIT_GAIN = 1.5
BIAS_LEVEL, BIAS_GAIN = 16.0, 0.5
SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}


class LoadedModel(NamedTuple):
    model: CausalLM
    config: ModelConfig
    tokenizer: Tokenizer | None  # None when a checkpoint folder ships no tokenizer.json


def baton_tiny_config() -> ModelConfig:
    """4 layers, hidden 256, 4 query / 2 KV heads over the byte tokenizer's vocabulary."""
    tok = ByteTokenizer()
    return ModelConfig(
        vocab_size=tok.vocab_size,
        hidden_size=256,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        intermediate_size=512,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        max_position=4096,
        tie_word_embeddings=False,
        bos_token_id=tok.BOS,
        eos_token_ids=(tok.EOS,),
        name=BATON_TINY,
    )


@torch.no_grad()
def build_baton_tiny(seed: int = 0) -> LoadedModel:
    """The default model: random weights drawn in a fixed order from `seed` (no download).

    Plain random init emits arbitrary bytes (mostly invalid UTF-8) and often loops, so the init
    is shaped to favour printable ASCII and to keep the specials (EOS) unlikely: outputs are
    readable gibberish that runs to max_tokens. It is a load generator, not a language model.
    """
    cfg = baton_tiny_config()
    with torch.device("meta"):
        model = CausalLM(cfg)
    model = model.to_empty(device="cpu")
    model.inv_freq.copy_(rope_inv_freq(cfg))
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith("embed_tokens.weight"):
            param.copy_(torch.randn(param.shape, generator=gen))
        else:  # linear weights [out, in]
            std = INIT_GAIN / math.sqrt(param.shape[1])
            param.copy_(torch.randn(param.shape, generator=gen) * std)
    # Hidden dimension 0 is a constant "bias" channel: every embedding holds BIAS_LEVEL there
    # and no residual branch reads (norm gain 0) or writes it, so after the final norm the LM
    # head's column 0 acts as a logit bias that favours printable ASCII over other bytes/specials.
    model.model.embed_tokens.weight[:, 0] = BIAS_LEVEL
    for layer in model.model.layers:
        layer.input_layernorm.weight[0] = 0.0
        layer.post_attention_layernorm.weight[0] = 0.0
        layer.self_attn.o_proj.weight[0].zero_()
        layer.mlp.down_proj.weight[0].zero_()
    printable = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    printable[32:127] = True
    printable[ord("\n")] = True
    model.lm_head.weight[:, 0] = torch.where(printable, BIAS_GAIN, -BIAS_GAIN)
    model.eval()
    return LoadedModel(model, cfg, ByteTokenizer())


def _config_from_hf(raw: dict[str, Any], folder: Path) -> ModelConfig:
    arch = (raw.get("architectures") or [None])[0]
    kind = SUPPORTED_ARCHITECTURES.get(arch) or (
        raw.get("model_type") if raw.get("model_type") in ("llama", "qwen2") else None
    )
    if kind is None:
        raise ValueError(
            f"unsupported architecture {arch!r} (model_type {raw.get('model_type')!r}) in "
            f"{folder}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if kind == "qwen2" and raw.get("use_sliding_window"):
        raise ValueError(f"{folder}: Qwen2 sliding-window attention is not supported")
    if raw.get("pretraining_tp", 1) not in (1, None):
        raise ValueError(f"{folder}: pretraining_tp != 1 is not supported")
    # transformers 5 moves rope settings into `rope_parameters`; 4.x keeps rope_theta/rope_scaling.
    rope = dict(raw.get("rope_parameters") or {})
    rope_theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
    scaling = raw.get("rope_scaling") or rope or None
    if scaling is not None:
        scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
        if scaling.get("rope_type", scaling.get("type", "default")) == "default":
            scaling = None
    heads = raw["num_attention_heads"]
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    bias = bool(raw.get("attention_bias", False))
    return ModelConfig(
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
        intermediate_size=raw["intermediate_size"],
        rope_theta=float(rope_theta),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position=raw.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids,
        name=raw.get("_name_or_path") or folder.name,
        attention_bias=True if kind == "qwen2" else bias,
        attention_out_bias=False if kind == "qwen2" else bias,
        mlp_bias=bool(raw.get("mlp_bias", False)),
        rope_scaling=scaling,
    )


def _read_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        shards = sorted(p.name for p in folder.glob("*.safetensors"))
    if not shards:
        raise ValueError(f"no *.safetensors weights in {folder}")
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        state.update(load_file(str(folder / shard)))
    return state


def load_hf_checkpoint(folder: str | Path, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Load a Hugging Face-layout Llama / Qwen2 checkpoint (config.json + safetensors)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"model folder not found: {folder}")
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ValueError(f"no config.json in model folder {folder}")
    cfg = _config_from_hf(json.loads(config_path.read_text()), folder)
    with torch.device("meta"):
        model = CausalLM(cfg)
    state = {k: v for k, v in _read_state_dict(folder).items() if "rotary_emb" not in k}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    expected = {
        k for k in model.state_dict() if not (cfg.tie_word_embeddings and k == "lm_head.weight")
    }
    missing, unexpected = sorted(expected - state.keys()), sorted(state.keys() - expected)
    if missing or unexpected:
        raise ValueError(
            f"{folder}: checkpoint does not fit {cfg.name}: missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}"
        )
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.inv_freq = rope_inv_freq(cfg)  # the buffer was created on meta
    model.eval()
    tok_path = folder / "tokenizer.json"
    eos = cfg.eos_token_ids[0] if cfg.eos_token_ids else None
    tokenizer = HFTokenizer(tok_path, eos_id=eos) if tok_path.is_file() else None
    return LoadedModel(model, cfg, tokenizer)


def load_model(spec: str, dtype: torch.dtype = torch.float32, seed: int = 0) -> LoadedModel:
    """`spec` is "baton-tiny" or a local checkpoint folder."""
    if spec == BATON_TINY:
        loaded = build_baton_tiny(seed)
        return loaded._replace(model=loaded.model.to(dtype)) if dtype != torch.float32 else loaded
    if not Path(spec).is_dir():
        raise ValueError(f"unknown model {spec!r}: not {BATON_TINY!r} and not an existing folder")
    return load_hf_checkpoint(spec, dtype)
