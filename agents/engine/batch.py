"""Flattens a varlen batch (each request: k new tokens on top of its cached positions) into the
index tensors that the model's paged attention reads and writes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch


class SeqChunk(NamedTuple):
    """One request's part of a forward: `token_ids` at positions cached_len, cached_len+1, ..."""

    token_ids: Sequence[int]  # the extend_len new tokens
    cached_len: int  # positions whose KV is already in the pool
    block_table: Sequence[int]  # must cover cached_len + len(token_ids) positions


class ForwardBatch(NamedTuple):
    """Index tensors for one forward over T new tokens of B requests (Q = max new tokens of a
    request, K = max positions of a request after this forward)."""

    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long, absolute positions for RoPE
    write_slots: torch.Tensor  # [T] long, flat pool slot (block * block_size + offset) per token
    read_slots: torch.Tensor  # [B, K] long, flat pool slots of each request's positions (pad 0)
    attn_mask: torch.Tensor  # [B, 1, Q, K] bool, True where a query may attend a key
    query_index: torch.Tensor  # [B, Q] long, row of T for each padded query (pad: last token)
    token_seq: torch.Tensor  # [T] long, request of each token
    token_row: torch.Tensor  # [T] long, padded query row of each token
    last_index: torch.Tensor  # [B] long, row of T holding each request's last new token

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    def to(self, device: torch.device) -> ForwardBatch:
        """The same batch with every tensor on ``device`` (built on the CPU, then moved once)."""
        if device.type == "cpu":
            return self
        return ForwardBatch(*(t.to(device, non_blocking=True) for t in self))


def build_forward_batch(chunks: Sequence[SeqChunk], block_size: int) -> ForwardBatch:
    """Index tensors for `chunks`; a padded layout so attention is one call for the batch."""
    assert chunks, "a forward needs at least one request"
    extend = torch.tensor([len(c.token_ids) for c in chunks], dtype=torch.long)  # [B]
    cached = torch.tensor([c.cached_len for c in chunks], dtype=torch.long)  # [B]
    assert bool((extend > 0).all()), "every request in a forward needs at least one new token"
    total = cached + extend  # [B]
    for c, t in zip(chunks, total.tolist(), strict=True):
        assert len(c.block_table) * block_size >= t, (
            f"block table of {len(c.block_table)} blocks cannot hold {t} positions"
        )
    num_seqs, q_max, k_max = len(chunks), int(extend.max()), int(total.max())
    max_blocks = -(-k_max // block_size)
    tables = torch.zeros(num_seqs, max_blocks, dtype=torch.long)  # [B, max_blocks]
    for i, c in enumerate(chunks):
        n = min(len(c.block_table), max_blocks)
        tables[i, :n] = torch.tensor(list(c.block_table[:n]), dtype=torch.long)

    input_ids = torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.long)
    starts = torch.cumsum(extend, 0) - extend  # [B] first row of each request in T
    token_seq = torch.repeat_interleave(torch.arange(num_seqs), extend)  # [T]
    token_row = torch.arange(input_ids.numel()) - starts[token_seq]  # [T]
    positions = cached[token_seq] + token_row  # [T]
    write_slots = tables[token_seq, positions // block_size] * block_size + positions % block_size

    key_pos = torch.arange(k_max)  # [K]
    key_valid = key_pos[None, :] < total[:, None]  # [B, K]
    read_slots = tables[:, key_pos // block_size] * block_size + key_pos % block_size
    read_slots = torch.where(key_valid, read_slots, 0)
    query_pos = cached[:, None] + torch.arange(q_max)[None, :]  # [B, Q] absolute positions
    # Causal inside the new tokens; padded query rows still see key 0, so no row is all -inf.
    attn_mask = (key_pos[None, None, :] <= query_pos[:, :, None]) & key_valid[:, None, :]
    rows = torch.minimum(torch.arange(q_max)[None, :], (extend - 1)[:, None])  # [B, Q]
    query_index = starts[:, None] + rows
    last_index = starts + extend - 1
    return ForwardBatch(
        input_ids,
        positions,
        write_slots,
        read_slots,
        attn_mask[:, None],
        query_index,
        token_seq,
        token_row,
        last_index,
    )
