"""Token ids on the data plane: a JSON list of integers, or packed.

A prompt of 64K tokens as a JSON list costs the sender ~5 ms to encode and the receiver ~8 ms
to decode and check, once per call that carries it (the gateway's calls to P and to MD). The
packed form is a string: the ids as little-endian unsigned 32-bit words, base64-encoded
(standard alphabet, padded): ~0.7 ms to pack and ~3 ms to unpack and check. Every data-plane
endpoint that takes token ids accepts both (agents/PROTOCOL.md). Torch-free."""

from __future__ import annotations

import base64
import binascii
import sys
from array import array
from collections.abc import Sequence

_BIG_ENDIAN = sys.byteorder == "big"
_CODE = "I" if array("I").itemsize == 4 else "L"


def packed_u32(token_ids: Sequence[int]) -> bytes:
    """The ids as little-endian unsigned 32-bit words (OverflowError outside [0, 2**32))."""
    words = array(_CODE, token_ids)
    if _BIG_ENDIAN:
        words.byteswap()
    return words.tobytes()


def to_wire(token_ids: Sequence[int]) -> str:
    """The packed form of ``token_ids``."""
    return base64.b64encode(packed_u32(token_ids)).decode("ascii")


def from_wire(text: str) -> list[int]:
    """The ids of a packed string; ValueError naming what is wrong with it."""
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("packed token ids must be base64 (standard alphabet, padded)") from None
    if len(raw) % 4:
        raise ValueError(f"packed token ids are {len(raw)} bytes, not a whole number of 32-bit ids")
    words = array(_CODE)
    words.frombytes(raw)
    if _BIG_ENDIAN:
        words.byteswap()
    return words.tolist()
