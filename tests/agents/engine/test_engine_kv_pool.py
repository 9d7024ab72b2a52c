"""Paged KV pool: block accounting and the export/import wire format."""

from __future__ import annotations

import struct

import pytest
import torch

from agents.engine import OutOfBlocks, PagedKVPool, read_kv_header
from agents.engine.kv_pool import KV_HEADER_BYTES

LAYERS, HEADS, DIM, BS = 2, 2, 4, 4


def _pool(num_blocks: int = 8) -> PagedKVPool:
    pool = PagedKVPool(LAYERS, HEADS, DIM, num_blocks, BS)
    gen = torch.Generator().manual_seed(0)
    pool.k_cache.copy_(torch.randn(pool.k_cache.shape, generator=gen))
    pool.v_cache.copy_(torch.randn(pool.v_cache.shape, generator=gen))
    return pool


def test_allocate_and_free_track_usage() -> None:
    pool = PagedKVPool(LAYERS, HEADS, DIM, num_blocks=4, block_size=BS)
    assert pool.k_cache.shape == (LAYERS, 4, BS, HEADS, DIM)
    blocks = pool.allocate(3)
    assert blocks == [0, 1, 2]
    assert (pool.num_used_blocks, pool.num_free_blocks) == (3, 1)
    with pytest.raises(OutOfBlocks):
        pool.allocate(2)
    pool.free(blocks[:2])
    assert (pool.num_used_blocks, pool.num_free_blocks) == (1, 3)
    with pytest.raises(AssertionError, match="double free"):
        pool.free([0])


def test_export_layout_is_header_then_k_and_v_by_layer_token_head() -> None:
    pool = _pool()
    table = [5, 2, 7]  # positions 0-3 in block 5, 4-7 in block 2, 8-11 in block 7
    payload = pool.export_kv(table, start_token=4, end_token=10)  # ends mid-block
    assert struct.unpack_from("<4sBBHHHIII", payload) == (
        b"BKV1",
        1,
        0,
        LAYERS,
        HEADS,
        DIM,
        4,
        10,
        0,
    )
    assert len(payload) == KV_HEADER_BYTES + 2 * LAYERS * 6 * HEADS * DIM * 4
    body = torch.frombuffer(bytearray(payload[KV_HEADER_BYTES:]), dtype=torch.float32)
    body = body.view(2, LAYERS, 6, HEADS, DIM)
    # token 4 is block 2 offset 0; token 9 is block 7 offset 1
    assert torch.equal(body[0, 1, 0], pool.k_cache[1, 2, 0])
    assert torch.equal(body[1, 0, 5], pool.v_cache[0, 7, 1])


def test_import_writes_the_range_into_fresh_blocks() -> None:
    src, dst = _pool(), PagedKVPool(LAYERS, HEADS, DIM, 8, BS)
    table = [5, 2, 7]
    payload = src.export_kv(table, 4, 11)
    fresh = dst.allocate(2)
    header = dst.import_kv(payload, fresh)
    assert (header.start_token, header.end_token, header.num_tokens) == (4, 11, 7)
    for t in range(4, 11):
        s_block, d_block = table[t // BS], fresh[(t - 4) // BS]
        assert torch.equal(dst.k_cache[:, d_block, t % BS], src.k_cache[:, s_block, t % BS])
        assert torch.equal(dst.v_cache[:, d_block, t % BS], src.v_cache[:, s_block, t % BS])


def test_import_rejects_start_inside_a_block_and_wrong_shapes() -> None:
    src = _pool()
    with pytest.raises(ValueError, match="not a multiple"):
        src.import_kv(src.export_kv([0, 1], 2, 6), [3])
    other = PagedKVPool(LAYERS, HEADS, DIM * 2, 8, BS)
    with pytest.raises(ValueError, match="does not match"):
        other.import_kv(src.export_kv([0], 0, 4), [1])
    with pytest.raises(ValueError, match="blocks"):
        src.import_kv(src.export_kv([0, 1], 0, 8), [3])


def test_empty_range_round_trips() -> None:
    pool = _pool()
    payload = pool.export_kv([0], 4, 4)
    assert len(payload) == KV_HEADER_BYTES
    assert read_kv_header(payload).num_tokens == 0
    assert pool.import_kv(payload, []).num_tokens == 0


def test_bfloat16_pool_exports_its_own_dtype() -> None:
    pool = PagedKVPool(LAYERS, HEADS, DIM, 4, BS, dtype=torch.bfloat16)
    pool.k_cache.fill_(1.5)
    payload = pool.export_kv([0], 0, 3)
    assert read_kv_header(payload).dtype == torch.bfloat16
    assert len(payload) == KV_HEADER_BYTES + 2 * LAYERS * 3 * HEADS * DIM * 2
    dst = PagedKVPool(LAYERS, HEADS, DIM, 4, BS, dtype=torch.bfloat16)
    dst.import_kv(payload, [2])
    assert torch.equal(dst.k_cache[:, 2, :3], pool.k_cache[:, 0, :3])
