"""Random-weight Hugging Face checkpoints for the engine benchmark (no download): the issue-24
shape (hidden 512, 8 layers, 8 query / 2 KV heads, MLP 1,408, vocab 8,192, untied head) in the
Llama and the Qwen2 layout, and a `large` shape whose float32 weights (1.15 GB) are more than
twice the largest CPU cache we have measured on (480 MB of L3), so a decode step reads them
from memory. Every weight is drawn from N(0, 0.02) with a fixed seed, biases included, so
each one counts."""

from __future__ import annotations

from pathlib import Path

SHAPE = dict(
    hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
    num_key_value_heads=2, vocab_size=8192, max_position_embeddings=4096,
    tie_word_embeddings=False,
)  # fmt: skip
SHAPES = {
    "issue24": SHAPE,
    "large": dict(
        SHAPE, hidden_size=1024, intermediate_size=2816, num_hidden_layers=24,
        num_attention_heads=16, num_key_value_heads=4, vocab_size=16384,
    ),
}  # fmt: skip
LAYOUTS = ("qwen2", "llama")


def checkpoint_dir(root: Path, layout: str, shape: str = "issue24") -> Path:
    """Where the checkpoint of `layout` in `shape` lives under `root`."""
    return Path(root) / (f"ckpt-{layout}" if shape == "issue24" else f"ckpt-{layout}-{shape}")


def make_checkpoint(layout: str, out: Path, seed: int = 0, shape: str = "issue24") -> Path:
    """Write (once) a float32 checkpoint of `layout` in `shape` into `out`; returns it."""
    import torch
    import transformers

    out = Path(out)
    if (out / "config.json").is_file():
        return out
    torch.manual_seed(seed)
    if layout == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SHAPES[shape]))
    elif layout == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPES[shape]))
    else:
        raise ValueError(f"unknown layout {layout!r}; use one of {LAYOUTS}")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(0.02 * torch.randn(param.shape, generator=gen))
    out.mkdir(parents=True, exist_ok=True)
    model.float().save_pretrained(out, safe_serialization=True)
    return out
