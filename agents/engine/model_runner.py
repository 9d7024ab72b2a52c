"""Runs one scheduled batch through the model: gathers each request's pending tokens, runs the
forward against the paged pool and returns logits for the requests whose last position ran.

A step where every request runs exactly one new token (decode) takes the fast path in
`agents/engine/decode.py`; prefill, chunked prefill, extend (the handoff's recompute) and mixed
batches take the general forward."""

from __future__ import annotations

import torch

from agents.engine.batch import SeqChunk, build_forward_batch
from agents.engine.decode import DecodeState, decode_forward
from agents.engine.kv_pool import PagedKVPool
from agents.engine.model import CausalLM
from agents.engine.request import Request


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        pool: PagedKVPool,
        *,
        decode_fast_path: bool = True,
        decode_int8: bool = False,
        decode_packed: bool = False,
        decode_stream: bool = False,
        decode_compile: bool = False,
    ) -> None:
        self.model = model
        self.pool = pool
        self.decode_fast_path = decode_fast_path
        self.decode_int8 = decode_int8  # int8 weight-only linears in fast-path steps
        self.decode_packed = decode_packed  # oneDNN-prepacked weights in fast-path steps
        self.decode_stream = decode_stream  # the skinny kernel's weights in fast-path steps
        # With stream: the decoder layers in one C++ call where they can (False: op by op, to
        # compare the two; bench.engine's stream-ops arm).
        self.decode_one_call = True
        self.decode_compile = decode_compile  # fast-path steps through torch.compile
        self.decode_state = DecodeState()
        self.fast_steps = 0

    @torch.inference_mode()
    def run(self, requests: list[Request], num_tokens: list[int]) -> torch.Tensor:
        """Run `num_tokens[i]` pending positions of each request and advance its cached_len.

        Returns float32 CPU logits [m, vocab] for the m requests (in order) whose pending positions
        are now all computed; a chunked prompt that is not finished gets no row."""
        if self.decode_fast_path and all(
            n == 1 == req.extend_len for req, n in zip(requests, num_tokens, strict=True)
        ):
            return self._run_decode(requests)
        self.decode_state.invalidate()
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

    def _run_decode(self, requests: list[Request]) -> torch.Tensor:
        pool, state, bs = self.pool, self.decode_state, self.pool.block_size
        cached = [req.cached_len for req in requests]
        for req, n in zip(requests, cached, strict=True):
            assert len(req.block_table) * bs > n, f"{req.request_id}: block table too short"
        if not state.continues(requests, cached):
            k, v = pool.k_cache, pool.v_cache
            layers, blocks, _, heads, dim = k.shape
            shape = (layers, blocks * bs, heads, dim)
            slots = [
                pool.slots(req.block_table, 0, n) for req, n in zip(requests, cached, strict=True)
            ]
            state.rebuild(requests, cached, slots, k.view(shape), v.view(shape))
        device = pool.device
        input_ids = torch.tensor([req.token_ids[-1] for req in requests], device=device)
        write_slots = torch.tensor(
            [
                req.block_table[n // bs] * bs + n % bs
                for req, n in zip(requests, cached, strict=True)
            ],
            device=device,
        )
        logits = decode_forward(
            self.model,
            state,
            input_ids,
            write_slots,
            pool.k_cache,
            pool.v_cache,
            int8=self.decode_int8,
            packed=self.decode_packed,
            stream=self.decode_stream,
            one_call=self.decode_one_call,
            compiled=self.decode_compile,
        )
        for req in requests:
            req.cached_len += 1
        self.fast_steps += 1
        return logits.cpu()
