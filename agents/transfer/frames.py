"""Binary frame format for KV transfers: encode frames, and read them back from a stream.

A transfer is a run of KV_BLOCKS (and optionally TOKENS) frames for one request id, closed by an
END frame that states how many payload bytes and frames came before it. See README.md for the
byte layout.
"""

from __future__ import annotations

import asyncio
import struct
import zlib
from collections.abc import Iterable
from enum import IntEnum
from typing import NamedTuple

from agents.transfer.errors import (
    BadMagicError,
    ChecksumError,
    MalformedFrameError,
    OversizeFrameError,
    StreamClosedError,
    TruncatedFrameError,
    UnsupportedVersionError,
)

MAGIC = b"BTKV"
VERSION = 1
# magic, version, kind, request-id length, block_start, block_end, token_start, token_end,
# payload length, payload CRC32, header CRC32. Network byte order, no padding: 40 bytes.
HEADER = struct.Struct("!4sBBHIIIIQII")
HEADER_SIZE = HEADER.size
MAX_REQUEST_ID_BYTES = 256
DEFAULT_MAX_PAYLOAD_BYTES = 64 * 1024 * 1024
U32_MAX = 2**32 - 1
# END payload: total payload bytes of the transfer's data frames, and their count.
END_SUMMARY = struct.Struct("!QI")

Payload = bytes | bytearray | memoryview


class FrameKind(IntEnum):
    """What a frame carries; stored in one byte of the header."""

    KV_BLOCKS = 1  # opaque KV-cache bytes for blocks [block_start, block_end)
    TOKENS = 2  # token ids for positions [token_start, token_end), uint32 each
    END = 3  # closes a transfer; payload is END_SUMMARY
    ERROR = 4  # the sender aborts the transfer; payload is a UTF-8 reason
    HELLO = 5  # first frame of a connection to a server with a token; payload is the token


DATA_KINDS = frozenset({FrameKind.KV_BLOCKS, FrameKind.TOKENS})


class Frame(NamedTuple):
    """One decoded, checksum-verified frame."""

    kind: FrameKind
    request_id: str
    block_start: int
    block_end: int
    token_start: int
    token_end: int
    payload: bytes
    wire_bytes: int  # header + request id + payload, as it crossed the stream


class EndSummary(NamedTuple):
    """What an END frame promises about the transfer it closes."""

    payload_bytes: int
    frames: int


def _check_u32(name: str, value: int) -> None:
    if not 0 <= value <= U32_MAX:
        raise ValueError(f"{name} must be in [0, {U32_MAX}], got {value}")


def _encode_request_id(request_id: str) -> bytes:
    raw = request_id.encode("utf-8")
    if not raw or len(raw) > MAX_REQUEST_ID_BYTES:
        raise ValueError(
            f"request_id must be 1..{MAX_REQUEST_ID_BYTES} UTF-8 bytes, got {len(raw)}"
        )
    return raw


def encode_frame_header(
    kind: FrameKind,
    request_id: str,
    payload: Payload = b"",
    *,
    block_start: int = 0,
    block_end: int = 0,
    token_start: int = 0,
    token_end: int = 0,
) -> bytes:
    """Return the header and request id of a frame; the caller writes `payload` right after.

    Split from `encode_frame` so a sender can pace a large payload without copying it.
    """
    kind = FrameKind(kind)
    for name, value in (
        ("block_start", block_start),
        ("block_end", block_end),
        ("token_start", token_start),
        ("token_end", token_end),
    ):
        _check_u32(name, value)
    if block_end < block_start:
        raise ValueError(f"block range [{block_start}, {block_end}) is inverted")
    if token_end < token_start:
        raise ValueError(f"token range [{token_start}, {token_end}) is inverted")
    rid = _encode_request_id(request_id)
    fields = [
        MAGIC,
        VERSION,
        kind,
        len(rid),
        block_start,
        block_end,
        token_start,
        token_end,
        len(payload),
        zlib.crc32(payload),
        0,
    ]
    header_crc = zlib.crc32(rid, zlib.crc32(HEADER.pack(*fields)))
    fields[-1] = header_crc
    return HEADER.pack(*fields) + rid


def encode_frame(
    kind: FrameKind,
    request_id: str,
    payload: Payload = b"",
    *,
    block_start: int = 0,
    block_end: int = 0,
    token_start: int = 0,
    token_end: int = 0,
) -> bytes:
    """Return one complete frame (header, request id, payload) as bytes."""
    header = encode_frame_header(
        kind,
        request_id,
        payload,
        block_start=block_start,
        block_end=block_end,
        token_start=token_start,
        token_end=token_end,
    )
    return header + bytes(payload)


def encode_end(request_id: str, *, payload_bytes: int, frames: int) -> bytes:
    """Return the END frame that closes a transfer of `frames` data frames."""
    return encode_frame(FrameKind.END, request_id, END_SUMMARY.pack(payload_bytes, frames))


HELLO_REQUEST_ID = "hello"


def encode_hello(token: str) -> bytes:
    """Return the HELLO frame that opens a connection to a fabric server with a token."""
    return encode_frame(FrameKind.HELLO, HELLO_REQUEST_ID, token.encode("utf-8"))


def encode_error(request_id: str, reason: str) -> bytes:
    """Return an ERROR frame: the sender gives up on `request_id` for `reason`."""
    return encode_frame(FrameKind.ERROR, request_id, reason.encode("utf-8"))


def encode_token_ids(token_ids: Iterable[int]) -> bytes:
    """Pack token ids as big-endian uint32, the TOKENS payload format."""
    ids = list(token_ids)
    for token_id in ids:
        _check_u32("token id", token_id)
    return struct.pack(f"!{len(ids)}I", *ids)


def decode_token_ids(payload: bytes) -> tuple[int, ...]:
    """Unpack a TOKENS payload; raises MalformedFrameError if it is not whole uint32s."""
    if len(payload) % 4:
        raise MalformedFrameError(f"TOKENS payload of {len(payload)} bytes is not uint32s")
    return struct.unpack(f"!{len(payload) // 4}I", payload)


def decode_end(frame: Frame) -> EndSummary:
    """Read the summary out of an END frame."""
    if frame.kind is not FrameKind.END or len(frame.payload) != END_SUMMARY.size:
        raise MalformedFrameError(
            f"not a valid END frame: kind {frame.kind.name}, {len(frame.payload)} bytes",
            request_id=frame.request_id,
        )
    return EndSummary(*END_SUMMARY.unpack(frame.payload))


async def _read_exactly(
    reader: asyncio.StreamReader, size: int, what: str, request_id: str | None
) -> bytes:
    try:
        return await reader.readexactly(size)
    except asyncio.IncompleteReadError as exc:
        raise TruncatedFrameError(
            f"stream ended after {len(exc.partial)} of {size} bytes of the {what}",
            request_id=request_id,
        ) from None


async def read_frame(
    reader: asyncio.StreamReader, *, max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
) -> Frame:
    """Read and verify the next frame from `reader`.

    Raises StreamClosedError at a clean end of stream (no byte of a new frame), and another
    FrameError subclass for a bad magic, unsupported version, truncated frame, malformed header,
    checksum mismatch or a payload above `max_payload_bytes`. The payload is only read after the
    header has passed every check, so an oversize frame never allocates its payload.
    """
    try:
        raw = await reader.readexactly(HEADER_SIZE)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            raise StreamClosedError("stream closed between frames") from None
        raise TruncatedFrameError(
            f"stream ended after {len(exc.partial)} of {HEADER_SIZE} header bytes"
        ) from None
    (
        magic,
        version,
        kind,
        rid_len,
        block_start,
        block_end,
        token_start,
        token_end,
        payload_len,
        payload_crc,
        header_crc,
    ) = HEADER.unpack(raw)
    if magic != MAGIC:
        raise BadMagicError(f"bad magic {magic!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise UnsupportedVersionError(f"frame version {version}, this reader speaks {VERSION}")
    if not 0 < rid_len <= MAX_REQUEST_ID_BYTES:
        raise MalformedFrameError(f"request id length {rid_len} out of 1..{MAX_REQUEST_ID_BYTES}")
    rid = await _read_exactly(reader, rid_len, "request id", None)
    # Checksum the header with its own CRC field zeroed, as the encoder did.
    expected_header_crc = zlib.crc32(rid, zlib.crc32(raw[:-4] + b"\0\0\0\0"))
    if header_crc != expected_header_crc:
        raise ChecksumError("header checksum mismatch")
    try:
        request_id = rid.decode("utf-8")
    except UnicodeDecodeError:
        raise MalformedFrameError("request id is not UTF-8") from None
    try:
        frame_kind = FrameKind(kind)
    except ValueError:
        raise MalformedFrameError(f"unknown frame kind {kind}", request_id=request_id) from None
    if block_end < block_start or token_end < token_start:
        raise MalformedFrameError(
            f"inverted range: blocks [{block_start}, {block_end}), "
            f"tokens [{token_start}, {token_end})",
            request_id=request_id,
        )
    if payload_len > max_payload_bytes:
        raise OversizeFrameError(
            f"payload of {payload_len} bytes exceeds the limit of {max_payload_bytes}",
            request_id=request_id,
        )
    payload = await _read_exactly(reader, payload_len, "payload", request_id)
    if zlib.crc32(payload) != payload_crc:
        raise ChecksumError("payload checksum mismatch", request_id=request_id)
    return Frame(
        kind=frame_kind,
        request_id=request_id,
        block_start=block_start,
        block_end=block_end,
        token_start=token_start,
        token_end=token_end,
        payload=payload,
        wire_bytes=HEADER_SIZE + rid_len + payload_len,
    )
