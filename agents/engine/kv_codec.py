"""KV payloads in other formats than the engine's own: dtype conversion and 8-bit transport.

The wire format (agents/engine/kv_pool.py) carries its dtype in the header. This module turns
a payload into another format and back, so that P and MD need not store KV alike and the WAN
may carry fewer bytes than the engines hold:

- **dtype conversion** (float32 / bfloat16 / float16 to any of them): the body cast element by
  element. Widening (bfloat16 or float16 to float32) is lossless; narrowing rounds.
- **8-bit transport** (``int8``, dtype code 3): each K and V value as a signed byte times a
  scale, one float32 scale per (K or V, layer, block of ``INT8_BLOCK_TOKENS`` tokens, KV head):
  the absolute maximum of that block's values over 127 (symmetric, round to nearest). The body
  is the scales tensor ``[2, layers, blocks, heads]`` (float32) followed by the values
  ``[2, layers, tokens, heads, head_dim]`` (int8); ``reserved`` in the header holds the block
  size in tokens. A float32 payload shrinks to ~1/4 (plus 4 bytes of scale per block x head:
  0.4% at 16 tokens x 64 dims), a bfloat16 one to ~1/2. Lossy: decoding gives each value
  within half a step (absmax / 254) of the original.

A streamed export (P sends MD's delta in chunks as prefill completes them) arrives as several
payloads of consecutive token ranges, each whole in itself; ``join_payloads`` makes them one
(every chunk but the last a whole number of 8-bit scale blocks).

``to_format(payload, "int8" | dtype name)`` encodes; ``decode_to(payload, dtype name)`` gives a
payload of the engine's own dtype, which ``import_kv`` takes (it calls it for any other
format).
"""

from __future__ import annotations

import warnings

import numpy as np

from agents.engine.kv_pool import (
    INT8_CODE,
    KV_HEADER_BYTES,
    KVHeader,
    format_code,
    format_name,
    kv_header,
    read_kv_header,
)

__all__ = [
    "INT8_BLOCK_TOKENS",
    "convert_dtype",
    "decode_to",
    "dequantize_int8",
    "format_name",
    "join_payloads",
    "quantize_int8",
    "to_format",
]

INT8_BLOCK_TOKENS = 16


def _body(payload, header: KVHeader):
    """The float body of a payload as a torch tensor [2, L, n, H, D] (a view when possible)."""
    import torch

    shape = (2, header.num_layers, header.num_tokens, header.num_kv_heads, header.head_dim)
    if header.num_tokens == 0:  # a header alone (an empty range): no buffer to view
        return torch.empty(shape, dtype=header.dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only buffers: only read here
        raw = torch.frombuffer(memoryview(payload), dtype=torch.uint8, offset=KV_HEADER_BYTES)
    return raw.view(header.dtype).view(shape)


def _with_body(header: KVHeader, code: int, body, reserved: int = 0) -> bytes:
    import torch

    head = kv_header(code, header.num_layers, header.num_kv_heads, header.head_dim,
                     header.start_token, header.end_token, reserved)  # fmt: skip
    return head + body.contiguous().view(torch.uint8).numpy().tobytes()


def convert_dtype(payload: bytes | bytearray | memoryview, dtype: str) -> bytes:
    """A float payload in another float dtype (the same payload when it already is)."""
    from agents.engine.config import parse_dtype

    header = read_kv_header(payload)
    if header.dtype_code == INT8_CODE:
        raise ValueError("an 8-bit payload is decoded with decode_to, not converted")
    if header.dtype_name == dtype:
        return bytes(payload)
    body = _body(payload, header).to(parse_dtype(dtype))
    return _with_body(header, format_code(dtype), body)


def quantize_int8(
    payload: bytes | bytearray | memoryview, block_tokens: int = INT8_BLOCK_TOKENS
) -> bytes:
    """A float payload as 8-bit values with one scale per (K/V, layer, block, head)."""
    import torch

    header = read_kv_header(payload)
    if header.dtype_code == INT8_CODE:
        return bytes(payload)
    if not 1 <= block_tokens <= 65_535:
        raise ValueError(f"block_tokens must be 1..65535, got {block_tokens}")
    x = _body(payload, header).to(torch.float32)  # [2, L, n, H, D]
    two, layers, n, heads, dim = x.shape
    blocks = -(-n // block_tokens)
    pad = blocks * block_tokens - n
    padded = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad)) if pad else x
    grouped = padded.view(two, layers, blocks, block_tokens, heads, dim)
    absmax = grouped.abs().amax(dim=(3, 5))  # [2, L, blocks, H]
    scales = torch.where(absmax > 0, absmax / 127.0, torch.ones_like(absmax))
    q = torch.round(grouped / scales[:, :, :, None, :, None]).clamp_(-127, 127)
    values = q.to(torch.int8).view(two, layers, blocks * block_tokens, heads, dim)[:, :, :n]
    head = kv_header(INT8_CODE, header.num_layers, header.num_kv_heads, header.head_dim,
                     header.start_token, header.end_token, block_tokens)  # fmt: skip
    return (
        head
        + scales.contiguous().numpy().astype(np.float32).tobytes()
        + values.contiguous().view(torch.uint8).numpy().tobytes()
    )


def dequantize_int8(payload: bytes | bytearray | memoryview, dtype: str) -> bytes:
    """An 8-bit payload back in a float dtype."""
    import torch

    from agents.engine.config import parse_dtype

    header = read_kv_header(payload)
    if header.dtype_code != INT8_CODE:
        raise ValueError(f"not an 8-bit payload: {header.dtype_name}")
    block_tokens = header.reserved
    if block_tokens < 1:
        raise ValueError("8-bit payload without its block size")
    layers, n, heads, dim = (
        header.num_layers,
        header.num_tokens,
        header.num_kv_heads,
        header.head_dim,
    )
    blocks = -(-n // block_tokens)
    scale_bytes = 2 * layers * blocks * heads * 4
    expected = KV_HEADER_BYTES + scale_bytes + 2 * layers * n * heads * dim
    if len(payload) != expected:
        raise ValueError(f"8-bit KV payload is {len(payload)} bytes, expected {expected}")
    raw = bytes(payload)
    scales = torch.from_numpy(
        np.frombuffer(raw, dtype=np.float32, count=2 * layers * blocks * heads,
                      offset=KV_HEADER_BYTES).copy()
    ).view(2, layers, blocks, heads)  # fmt: skip
    values = torch.from_numpy(
        np.frombuffer(raw, dtype=np.int8, offset=KV_HEADER_BYTES + scale_bytes).copy()
    ).view(2, layers, n, heads, dim)
    per_token = scales.repeat_interleave(block_tokens, dim=2)[:, :, :n]  # [2, L, n, H]
    body = (values.to(torch.float32) * per_token[..., None]).to(parse_dtype(dtype))
    head = kv_header(format_code(dtype), layers, heads, dim, header.start_token,
                     header.end_token)  # fmt: skip
    return head + body.contiguous().view(torch.uint8).numpy().tobytes()


def encoded_size(payload: bytes | bytearray | memoryview, fmt: str) -> int:
    """The size of ``to_format(payload, fmt)``, from the header alone (no encoding)."""
    header = read_kv_header(payload)
    layers, n = header.num_layers, header.num_tokens
    heads, dim = header.num_kv_heads, header.head_dim
    if fmt == "int8":
        blocks = -(-n // INT8_BLOCK_TOKENS)
        return KV_HEADER_BYTES + 2 * layers * blocks * heads * 4 + 2 * layers * n * heads * dim
    elem = {"float32": 4, "bfloat16": 2, "float16": 2}[format_name(format_code(fmt))]
    return KV_HEADER_BYTES + 2 * layers * n * heads * dim * elem


def to_format(payload: bytes | bytearray | memoryview, fmt: str) -> bytes:
    """The payload in format ``fmt``: ``int8`` or a float dtype name."""
    format_code(fmt)  # ValueError naming the known formats
    if fmt == "int8":
        return quantize_int8(payload)
    header = read_kv_header(payload)
    if header.dtype_code == INT8_CODE:
        return dequantize_int8(payload, fmt)
    return convert_dtype(payload, fmt)


def join_payloads(payloads: list[bytes | bytearray | memoryview]) -> bytes:
    """Payloads of consecutive token ranges, in one format (a streamed export's chunks), as
    one payload of their whole range. ValueError when they are not consecutive, differ in
    format or shape, or an 8-bit chunk other than the last ends inside a scale block."""
    if not payloads:
        raise ValueError("no KV payloads to join")
    if len(payloads) == 1:
        return bytes(payloads[0])
    headers = [read_kv_header(p) for p in payloads]
    first = headers[0]
    shape = (first.dtype_code, first.num_layers, first.num_kv_heads, first.head_dim,
             first.reserved)  # fmt: skip
    for i, (a, b) in enumerate(zip(headers, headers[1:], strict=False), 1):
        if b.start_token != a.end_token:
            raise ValueError(
                f"KV chunk {i} starts at {b.start_token}, the one before ends at {a.end_token}"
            )
        if (b.dtype_code, b.num_layers, b.num_kv_heads, b.head_dim, b.reserved) != shape:
            raise ValueError(f"KV chunk {i} differs in format or shape from the first")
    layers, heads, dim = first.num_layers, first.num_kv_heads, first.head_dim
    head = kv_header(first.dtype_code, layers, heads, dim, first.start_token,
                     headers[-1].end_token, first.reserved)  # fmt: skip
    bodies = [np.frombuffer(memoryview(p), dtype=np.uint8, offset=KV_HEADER_BYTES)
              for p in payloads]  # fmt: skip
    if layers == 0:  # an emulated engine's payload: bytes per token, no tensor
        return head + b"".join(body.tobytes() for body in bodies)
    if first.dtype_code != INT8_CODE:
        elem = {0: 4, 1: 2, 2: 2}[first.dtype_code]
        parts = [b.reshape(2, layers, -1) for b in bodies]  # [2, L, n * H * D * elem]
        for part, h in zip(parts, headers, strict=True):
            if part.shape[2] != h.num_tokens * heads * dim * elem:
                raise ValueError(f"KV chunk [{h.start_token}, {h.end_token}) has a short body")
        return head + np.concatenate(parts, axis=2).tobytes()
    block = first.reserved
    scales, values = [], []
    for i, (body, h) in enumerate(zip(bodies, headers, strict=True)):
        if i < len(headers) - 1 and h.num_tokens % block:
            raise ValueError(f"8-bit KV chunk {i} ends inside a {block}-token scale block")
        blocks = -(-h.num_tokens // block)
        scale_bytes = 2 * layers * blocks * heads * 4
        if len(body) != scale_bytes + 2 * layers * h.num_tokens * heads * dim:
            raise ValueError(f"8-bit KV chunk {i} has {len(body)} body bytes, not its shape's")
        scales.append(body[:scale_bytes].reshape(2, layers, -1))
        values.append(body[scale_bytes:].reshape(2, layers, -1))
    return (
        head + np.concatenate(scales, axis=2).tobytes() + np.concatenate(values, axis=2).tobytes()
    )


def decode_to(payload: bytes | bytearray | memoryview, dtype: str) -> bytes:
    """The payload in the engine's own float dtype, whatever format it came in."""
    header = read_kv_header(payload)
    if header.dtype_code == INT8_CODE:
        return dequantize_int8(payload, dtype)
    return convert_dtype(payload, dtype)
