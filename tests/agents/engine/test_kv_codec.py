"""KV payloads in other formats (agents/engine/kv_codec.py): dtype conversion, lossless where
it widens, and 8-bit transport with per-block scales: its size, its error bound, and a pool of
another dtype importing either."""

from __future__ import annotations

import pytest
import torch

from agents.engine import PagedKVPool, read_kv_header
from agents.engine.kv_codec import (
    INT8_BLOCK_TOKENS,
    convert_dtype,
    decode_to,
    quantize_int8,
    to_format,
)
from agents.engine.kv_pool import KV_HEADER_BYTES

LAYERS, HEADS, DIM, BS = 3, 2, 64, 16


def _pool(dtype=torch.float32, num_blocks: int = 8, seed: int = 0) -> PagedKVPool:
    pool = PagedKVPool(LAYERS, HEADS, DIM, num_blocks, BS, dtype=dtype)
    gen = torch.Generator().manual_seed(seed)
    pool.k_cache.copy_(torch.randn(pool.k_cache.shape, generator=gen).to(dtype))
    pool.v_cache.copy_(3 * torch.randn(pool.v_cache.shape, generator=gen).to(dtype))
    return pool


def _body(payload: bytes) -> torch.Tensor:
    header = read_kv_header(payload)
    raw = torch.frombuffer(bytearray(payload[KV_HEADER_BYTES:]), dtype=torch.uint8)
    shape = (2, header.num_layers, header.num_tokens, header.num_kv_heads, header.head_dim)
    return raw.view(header.dtype).view(shape)


@pytest.mark.parametrize("narrow", [torch.bfloat16, torch.float16])
def test_widening_is_lossless_and_narrowing_rounds_once(narrow):
    source = _pool(narrow)
    payload = source.export_kv([1, 4, 6], 0, 40)
    wide = convert_dtype(payload, "float32")
    assert read_kv_header(wide).dtype_name == "float32"
    back = convert_dtype(wide, str(narrow).removeprefix("torch."))
    assert back == payload  # widened then narrowed again: the same bytes
    assert torch.equal(_body(wide), _body(payload).to(torch.float32))
    assert convert_dtype(payload, str(narrow).removeprefix("torch.")) == payload  # same dtype


def test_a_payload_of_another_dtype_is_decoded_into_the_pools():
    source = _pool(torch.bfloat16)
    payload = source.export_kv([2, 3], 0, 32)
    target = PagedKVPool(LAYERS, HEADS, DIM, 4, BS, dtype=torch.float32)
    with pytest.raises(ValueError, match="decode_to converts it"):
        target.import_kv(payload, [0, 1])  # the engine decodes first (EngineCore.import_prefix)
    header = target.import_kv(decode_to(payload, target.dtype_name), [0, 1])
    assert header.dtype_name == "float32"
    assert torch.equal(target.k_cache[:, 0], source.k_cache[:, 2].to(torch.float32))
    assert torch.equal(target.v_cache[:, 1], source.v_cache[:, 3].to(torch.float32))


def test_int8_transport_is_a_quarter_of_float32_and_half_of_bfloat16():
    for dtype, least in ((torch.float32, 3.5), (torch.bfloat16, 1.8)):
        payload = _pool(dtype).export_kv(list(range(8)), 0, 128)
        packed = quantize_int8(payload)
        header = read_kv_header(packed)
        assert header.dtype_name == "int8" and header.reserved == INT8_BLOCK_TOKENS
        ratio = (len(payload) - KV_HEADER_BYTES) / (len(packed) - KV_HEADER_BYTES)
        assert ratio >= least, (dtype, ratio)


def test_int8_decodes_within_half_a_step_of_each_block_and_heads_scale():
    payload = _pool(torch.float32).export_kv([7, 0, 5], 0, 37)  # a partial last block
    original = _body(payload)
    decoded = _body(decode_to(quantize_int8(payload), "float32"))
    assert decoded.shape == original.shape
    two, layers, n, heads, dim = original.shape
    for start in range(0, n, INT8_BLOCK_TOKENS):
        part = original[:, :, start : start + INT8_BLOCK_TOKENS]
        step = part.abs().amax(dim=(2, 4), keepdim=True) / 127.0  # per K/V, layer, head
        err = (decoded[:, :, start : start + INT8_BLOCK_TOKENS] - part).abs()
        assert torch.all(err <= step / 2 + 1e-6)


def test_int8_imports_into_any_float_pool_and_keeps_zeros_zero():
    source = _pool(torch.float32)
    source.k_cache[:, 1].zero_()
    payload = quantize_int8(source.export_kv([1, 2], 0, 32))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        target = PagedKVPool(LAYERS, HEADS, DIM, 2, BS, dtype=dtype)
        target.import_kv(decode_to(payload, target.dtype_name), [0, 1])
        assert torch.count_nonzero(target.k_cache[:, 0]) == 0  # an all-zero block stays zero
        err = (target.v_cache[:, 1].float() - source.v_cache[:, 2]).abs().max()
        assert err < 0.1


def test_formats_by_name_and_bad_ones():
    payload = _pool(torch.float16).export_kv([0], 0, 16)
    assert read_kv_header(to_format(payload, "int8")).dtype_name == "int8"
    assert read_kv_header(to_format(to_format(payload, "int8"), "bfloat16")).dtype_name == (
        "bfloat16"
    )
    with pytest.raises(ValueError, match="unknown KV format"):
        to_format(payload, "int4")
    with pytest.raises(ValueError, match="decode_to"):
        convert_dtype(to_format(payload, "int8"), "float32")
    truncated = to_format(payload, "int8")[:-3]
    with pytest.raises(ValueError, match="expected"):
        decode_to(truncated, "float32")


@pytest.mark.parametrize("fmt", [None, "bfloat16", "int8"])
def test_a_streamed_exports_chunks_join_into_the_whole_payload(fmt):
    """P's chunks of consecutive token ranges, each encoded alone, join into what encoding the
    whole range gives (byte for byte: 8-bit scales are per block, chunks end on blocks)."""
    from agents.engine.kv_codec import join_payloads

    pool = _pool(torch.float32)
    table = [1, 4, 6, 2, 7]
    cuts = [16, 48, 64, 75]  # block-aligned chunks; the last one ends mid-block
    pieces = [pool.export_kv(table, lo, hi) for lo, hi in zip([0, *cuts], cuts, strict=False)]
    whole = pool.export_kv(table, 0, 75)
    if fmt is not None:
        pieces, whole = [to_format(p, fmt) for p in pieces], to_format(whole, fmt)
    joined = join_payloads(pieces)
    assert joined == whole
    assert read_kv_header(joined).num_tokens == 75
    assert join_payloads([whole]) == whole


def test_joining_refuses_gaps_mixed_formats_and_a_cut_scale_block():
    from agents.engine.kv_codec import join_payloads

    pool = _pool(torch.float32)
    table = [1, 4, 6]
    a, b = pool.export_kv(table, 0, 16), pool.export_kv(table, 16, 40)
    with pytest.raises(ValueError, match="starts at 32"):
        join_payloads([a, pool.export_kv(table, 32, 40)])
    with pytest.raises(ValueError, match="format or shape"):
        join_payloads([a, convert_dtype(b, "float16")])
    with pytest.raises(ValueError, match="inside a 16-token scale block"):
        join_payloads([quantize_int8(pool.export_kv(table, 0, 20)),
                       quantize_int8(pool.export_kv(table, 20, 40))])  # fmt: skip
    with pytest.raises(ValueError, match="no KV payloads"):
        join_payloads([])


def test_emulated_chunks_join_by_their_bytes_per_token():
    from agents.engine.emulated import BlockPool
    from agents.engine.kv_codec import join_payloads

    pool = BlockPool(8, BS, 100)
    table = [0, 1, 2]
    joined = join_payloads([pool.export_kv(table, 0, 32), pool.export_kv(table, 32, 40)])
    assert joined == pool.export_kv(table, 0, 40)


def test_the_send_format_converts_once_on_the_cheaper_side():
    from agents.node.kv_stream import send_format

    assert send_format("int8", "float32", "bfloat16") == "int8"  # the link's choice
    assert send_format(None, "float32", "bfloat16") == "bfloat16"  # MD would narrow anyway
    assert send_format(None, "bfloat16", "float32") is None  # MD widens: send the narrow one
    assert send_format(None, "bfloat16", "float16") is None  # same width: MD converts
    assert send_format(None, "float32", None) is None  # an MD that does not say
    assert send_format(None, None, "bfloat16") is None  # an emulated P: no tensors


def test_an_empty_range_converts_to_a_header_alone():
    from agents.engine.kv_pool import kv_header

    empty = kv_header(0, LAYERS, HEADS, DIM, 32, 32)
    for fmt in ("int8", "bfloat16", "float32"):
        out = to_format(empty, fmt)
        assert len(out) == KV_HEADER_BYTES and read_kv_header(out).num_tokens == 0
    assert decode_to(to_format(empty, "int8"), "float32") == empty
