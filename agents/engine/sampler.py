"""Turns last-position logits into next tokens: greedy, or temperature + top-p with a
per-request generator so seeded sampling is reproducible."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from agents.engine.outputs import TokenLogprob
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


def token_logprobs(
    logits: torch.Tensor,  # [B, vocab] float32, the rows the tokens were sampled from
    tokens: Sequence[int],
    counts: Sequence[int],  # alternatives per row (SamplingParams.logprobs)
) -> list[TokenLogprob]:
    """Each sampled token's log-probability under the raw model distribution (log-softmax of
    the logits, before temperature and top-p: vLLM's default) and the `counts[i]` most likely
    tokens of its row, most likely first. Only the rows that asked pay for it."""
    assert logits.shape[0] == len(tokens) == len(counts), "one row per token"
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, torch.tensor(tokens, dtype=torch.long)[:, None])[:, 0].tolist()
    k = max(counts, default=0)
    if k:
        top_values, top_ids = logp.topk(min(k, logp.shape[-1]), dim=-1)
        top_values, top_ids = top_values.tolist(), top_ids.tolist()
    out = []
    for i, (value, n) in enumerate(zip(chosen, counts, strict=True)):
        top = tuple(zip(top_ids[i][:n], map(_finite, top_values[i][:n]), strict=True)) if n else ()
        out.append(TokenLogprob(_finite(value), top))
    return out


def _finite(logprob: float) -> float:
    """A probability that underflowed to 0 as -9999.0 (as vLLM does): JSON has no -inf."""
    return logprob if logprob > -9999.0 else -9999.0
