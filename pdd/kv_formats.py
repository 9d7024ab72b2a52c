"""KV transport formats: the names a WAN link may ask for (``WANLink.kv_format``) and what one
value of KV costs on the wire in each, so that the agents, the fleet API, the routing policy and
the simulator count a format's bytes the same way.

A format is a float dtype (``float32``, ``bfloat16``, ``float16``: lossless when widening) or
``int8``: one signed byte per value plus one float32 scale per (K or V, layer, block of
``INT8_BLOCK_TOKENS`` tokens, KV head), the real engine's 8-bit transport
(agents/engine/kv_codec.py). Its scale overhead depends on the head size; it is stated here for
a 64-value head (4 bytes per 16 x 64 values), the paper profile's and ``baton-tiny``'s."""

from __future__ import annotations

KV_FORMATS = ("float32", "bfloat16", "float16", "int8")
# The dtype a model profile's kv_bytes_per_token is taken to be in (profiles do not say): what
# an emulated engine holds and what the simulator's links carry unless a format says otherwise.
PROFILE_KV_DTYPE = "bfloat16"
INT8_BLOCK_TOKENS = 16
INT8_SCALE_HEAD_DIM = 64
BYTES_PER_VALUE = {
    "float32": 4.0,
    "bfloat16": 2.0,
    "float16": 2.0,
    "int8": 1.0 + 4.0 / (INT8_BLOCK_TOKENS * INT8_SCALE_HEAD_DIM),
}


def check_format(fmt: str) -> str:
    """``fmt`` when it is a known format; ValueError naming the known ones otherwise."""
    if fmt not in BYTES_PER_VALUE:
        raise ValueError(f"unknown KV format {fmt!r}; known: {', '.join(KV_FORMATS)}")
    return fmt


def wire_factor(fmt: str | None, own: str) -> float:
    """Bytes on the wire per byte of KV in the engine's own dtype ``own`` when sent as ``fmt``
    (None or "": its own, 1.0). float32 KV sent as int8: ~0.25; bfloat16 as float32: 2.0."""
    if not fmt or fmt == own:
        return 1.0
    return BYTES_PER_VALUE[check_format(fmt)] / BYTES_PER_VALUE[check_format(own)]
