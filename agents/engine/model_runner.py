"""Runs one scheduled batch through the model: gathers each request's pending tokens, runs the
forward against the paged pool and returns logits for the requests whose last position ran."""

from __future__ import annotations

import torch

from agents.engine.batch import SeqChunk, build_forward_batch
from agents.engine.kv_pool import PagedKVPool
from agents.engine.model import CausalLM
from agents.engine.request import Request


class ModelRunner:
    def __init__(self, model: CausalLM, pool: PagedKVPool) -> None:
        self.model = model
        self.pool = pool

    @torch.inference_mode()
    def run(self, requests: list[Request], num_tokens: list[int]) -> torch.Tensor:
        """Run `num_tokens[i]` pending positions of each request and advance its cached_len.

        Returns float32 CPU logits [m, vocab] for the m requests (in order) whose pending positions
        are now all computed; a chunked prompt that is not finished gets no row."""
        chunks = []
        for req, n in zip(requests, num_tokens, strict=True):
            assert 1 <= n <= req.extend_len, f"{req.request_id}: cannot run {n} positions"
            end = req.cached_len + n
            chunks.append(
                SeqChunk(req.token_ids[req.cached_len : end], req.cached_len, req.block_table)
            )
        batch = build_forward_batch(chunks, self.pool.block_size).to(self.pool.device)
        pairs = zip(requests, num_tokens, strict=True)
        complete = [i for i, (req, n) in enumerate(pairs) if n == req.extend_len]
        rows = batch.last_index[complete] if complete else batch.last_index[:0]
        logits = self.model(batch, self.pool.k_cache, self.pool.v_cache, rows)  # [m, vocab]
        for req, n in zip(requests, num_tokens, strict=True):
            req.cached_len += n
        # Sampling runs on the CPU (per-request CPU generators keep seeded sampling the same
        # on every device); [m, vocab] is small next to the forward.
        return logits.cpu()
