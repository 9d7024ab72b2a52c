"""Turns last-position logits into next tokens: greedy, or temperature + top-p with a
per-request generator so seeded sampling is reproducible."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from agents.engine.request import SamplingParams


def sample_tokens(
    logits: torch.Tensor,  # [B, vocab] float32
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[int]:
    assert logits.shape[0] == len(params) == len(generators), "one row per request"
    greedy = logits.argmax(dim=-1).tolist()
    out = []
    for row, p, gen, best in zip(logits, params, generators, greedy, strict=True):
        if p.greedy:
            out.append(best)
            continue
        probs = torch.softmax(row / p.temperature, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            # Keep the smallest head whose mass reaches top_p (always at least the top token).
            keep = sorted_probs.cumsum(0) - sorted_probs < p.top_p
            probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
        out.append(int(torch.multinomial(probs, 1, generator=gen)))
    return out
