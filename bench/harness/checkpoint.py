"""Random-weight Hugging Face checkpoints (no download), the one writer the benchmarks use: the
issue-24 shape (hidden 512, 8 layers, 8 query / 2 KV heads, MLP 1,408, vocab 8,192, untied
head) in the Llama and the Qwen2 layout; a `large` shape whose float32 weights (1.15 GB) are more
than twice the largest CPU cache we have measured on (480 MB of L3), so a decode step reads
them from memory; `llama-1b`, Llama-3.2-1B's layout (to time the engine at a real model's size
on a GPU); and `tiny` (2 layers, for tests). Every weight is drawn from N(0, 0.02) with a fixed
seed, biases included, so each one counts; the weights are noise: speed, not quality.

    .venv/bin/python -m bench.harness.checkpoint --layout llama --shape llama-1b \
        --dtype bfloat16 --out /tmp/llama-1b
    BATON_ENGINE_DEVICE=cuda python -m bench.engine throughput --model /tmp/llama-1b \
        --dtype bfloat16

Needs `transformers` (a dev dependency)."""

from __future__ import annotations

import argparse
import sys
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
    # Llama-3.2-1B: 16 layers, hidden 2048, 32 heads over 8 KV heads of 64, MLP 8192.
    "llama-1b": dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
        max_position_embeddings=8192, tie_word_embeddings=False,
    ),
    "tiny": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512, rope_theta=10000.0, max_position_embeddings=1024,
        tie_word_embeddings=False,
    ),
}  # fmt: skip
LAYOUTS = ("qwen2", "llama")


def checkpoint_dir(root: Path, layout: str, shape: str = "issue24") -> Path:
    """Where the checkpoint of `layout` in `shape` lives under `root`."""
    return Path(root) / (f"ckpt-{layout}" if shape == "issue24" else f"ckpt-{layout}-{shape}")


def make_checkpoint(
    layout: str, out: Path, seed: int = 0, shape: str = "issue24", dtype: str = "float32"
) -> Path:
    """Write (once) a checkpoint of `layout` in `shape` into `out`, its weights in `dtype`
    (float32 or bfloat16); returns it."""
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
    model.to(getattr(torch, dtype)).save_pretrained(out, safe_serialization=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.harness.checkpoint", description=__doc__.splitlines()[0]
    )
    ap.add_argument("--layout", choices=LAYOUTS, default="llama")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-1b")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True, help="folder to write (created)")
    args = ap.parse_args(argv)
    if (args.out / "config.json").is_file():
        print(f"{args.out} already holds a checkpoint: nothing written", file=sys.stderr)
        return 1
    make_checkpoint(args.layout, args.out, args.seed, args.shape, args.dtype)
    print(f"wrote {args.out}: {args.layout} {args.shape}, {args.dtype}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
