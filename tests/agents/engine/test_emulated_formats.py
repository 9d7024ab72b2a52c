"""An emulated KV payload in a transport format: the format's bytes per token (the profile's KV
taken as bfloat16), the same tokens, and an import that checks the size against its own."""

from __future__ import annotations

import pytest

from agents.engine.emulated import BlockPool, as_format
from agents.engine.kv_pool import KV_HEADER_BYTES, read_kv_header
from pdd.kv_formats import wire_factor


def test_a_payload_takes_each_formats_bytes_and_imports_on_an_engine_of_the_profile():
    pool = BlockPool(num_blocks=64, block_size=16, wire_bytes_per_token=44)
    payload = pool.export_kv(list(range(4)), 16, 64)  # 48 tokens
    assert read_kv_header(payload).dtype_name == "bfloat16"
    for fmt, per_token in (("int8", 22), ("float32", 88), ("float16", 44), ("bfloat16", 44)):
        sent = as_format(payload, fmt)
        header = read_kv_header(sent)
        assert (header.dtype_name, header.reserved) == (fmt, per_token)
        assert (header.start_token, header.end_token) == (16, 64)
        assert len(sent) == KV_HEADER_BYTES + 48 * per_token
        pool.import_kv(sent, [10, 11, 12])
        # From any format to any other: the same bytes as from the engine's own.
        assert as_format(as_format(payload, "float32"), fmt) == sent
    assert wire_factor("int8", "bfloat16") == pytest.approx(0.5 * (1 + 1 / 256))


def test_a_payload_of_another_size_per_token_is_refused_naming_the_cause():
    pool = BlockPool(num_blocks=64, block_size=16, wire_bytes_per_token=44)
    other = BlockPool(num_blocks=64, block_size=16, wire_bytes_per_token=40)  # another kv_scale
    sent = as_format(other.export_kv([0], 0, 16), "int8")
    with pytest.raises(ValueError, match="22 bytes per token in int8"):
        pool.import_kv(sent, [5])
    with pytest.raises(ValueError, match="unknown KV format"):
        as_format(pool.export_kv([0], 0, 16), "int4")
