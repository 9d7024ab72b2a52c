"""Write a Hugging Face-layout Llama checkpoint with random weights (no download), so the engine
can be timed at a real model's size: `--shape llama-1b` is Llama-3.2-1B's layout (untied head).

    .venv/bin/python bench/agents/random_checkpoint.py --shape llama-1b --out /tmp/llama-1b
    BATON_ENGINE_DEVICE=cuda python bench/engine_throughput.py --model /tmp/llama-1b \
        --dtype bfloat16

Needs `transformers` (a dev dependency). The weights are noise: throughput, not quality.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

SHAPES = {
    # Llama-3.2-1B: 16 layers, hidden 2048, 32 heads over 8 KV heads of 64, MLP 8192.
    "llama-1b": dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192,
    ),
    "tiny": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512, rope_theta=10000.0, max_position_embeddings=1024,
    ),
}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-1b")
    ap.add_argument("--out", type=Path, required=True, help="folder to write (created)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    config = LlamaConfig(**SHAPES[args.shape], tie_word_embeddings=False)
    model = LlamaForCausalLM(config).to(getattr(torch, args.dtype))
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    params = sum(p.numel() for p in model.parameters())
    print(f"wrote {args.out}: {args.shape}, {params / 1e9:.2f}B parameters, {args.dtype}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
