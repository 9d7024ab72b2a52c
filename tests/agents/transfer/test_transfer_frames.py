"""The KV frame format: what encode_frame writes, read_frame reads back or rejects."""

from __future__ import annotations

import asyncio
import zlib

import pytest

from agents.transfer.errors import (
    BadMagicError,
    ChecksumError,
    MalformedFrameError,
    OversizeFrameError,
    StreamClosedError,
    TruncatedFrameError,
    UnsupportedVersionError,
)
from agents.transfer.frames import (
    HEADER,
    HEADER_SIZE,
    MAGIC,
    FrameKind,
    decode_end,
    decode_token_ids,
    encode_end,
    encode_frame,
    encode_token_ids,
    read_frame,
)


async def _read(data: bytes, **kwargs: int):
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return await read_frame(reader, **kwargs)


def _kv_frame(payload: bytes = b"kv-bytes" * 100) -> bytes:
    return encode_frame(
        FrameKind.KV_BLOCKS,
        "req-7",
        payload,
        block_start=3,
        block_end=5,
        token_start=48,
        token_end=80,
    )


def _with_header_fields(frame: bytes, **changes: int) -> bytes:
    """Rewrite header fields and fix the header CRC, to reach checks behind the checksum."""
    names = [
        "magic",
        "version",
        "kind",
        "rid_len",
        "block_start",
        "block_end",
        "token_start",
        "token_end",
        "payload_len",
        "payload_crc",
        "header_crc",
    ]
    fields = dict(zip(names, HEADER.unpack(frame[:HEADER_SIZE]), strict=True))
    fields.update(changes, header_crc=0)
    rid = frame[HEADER_SIZE : HEADER_SIZE + fields["rid_len"]]
    fields["header_crc"] = zlib.crc32(rid, zlib.crc32(HEADER.pack(*fields.values())))
    return HEADER.pack(*fields.values()) + frame[HEADER_SIZE:]


def test_kv_frame_round_trips_every_field(run) -> None:
    payload = bytes(range(256)) * 40
    frame = run(_read(_kv_frame(payload)))

    assert frame.kind is FrameKind.KV_BLOCKS
    assert frame.request_id == "req-7"
    assert (frame.block_start, frame.block_end) == (3, 5)
    assert (frame.token_start, frame.token_end) == (48, 80)
    assert frame.payload == payload
    assert frame.wire_bytes == HEADER_SIZE + len("req-7") + len(payload)


def test_frames_are_read_back_to_back_in_order(run) -> None:
    async def read_two():
        reader = asyncio.StreamReader()
        reader.feed_data(_kv_frame(b"first") + encode_end("req-7", payload_bytes=5, frames=1))
        reader.feed_eof()
        return await read_frame(reader), await read_frame(reader)

    first, end = run(read_two())

    assert first.payload == b"first"
    assert end.kind is FrameKind.END
    assert tuple(decode_end(end)) == (5, 1)


def test_token_ids_round_trip_through_a_tokens_frame(run) -> None:
    ids = (0, 1, 151_643, 2**32 - 1)
    data = encode_frame(
        FrameKind.TOKENS, "r", encode_token_ids(ids), token_start=100, token_end=104
    )

    frame = run(_read(data))

    assert decode_token_ids(frame.payload) == ids


def test_empty_stream_raises_stream_closed(run) -> None:
    with pytest.raises(StreamClosedError):
        run(_read(b""))


def test_bad_magic_raises_bad_magic_error(run) -> None:
    data = b"XXXX" + _kv_frame()[len(MAGIC) :]

    with pytest.raises(BadMagicError):
        run(_read(data))


def test_other_version_raises_unsupported_version(run) -> None:
    with pytest.raises(UnsupportedVersionError):
        run(_read(_with_header_fields(_kv_frame(), version=9)))


def test_unknown_kind_raises_malformed_frame_naming_the_request(run) -> None:
    with pytest.raises(MalformedFrameError) as caught:
        run(_read(_with_header_fields(_kv_frame(), kind=77)))

    assert caught.value.request_id == "req-7"


def test_stream_ending_inside_the_header_raises_truncated(run) -> None:
    with pytest.raises(TruncatedFrameError):
        run(_read(_kv_frame()[: HEADER_SIZE - 1]))


def test_stream_ending_inside_the_payload_raises_truncated_with_request_id(run) -> None:
    with pytest.raises(TruncatedFrameError) as caught:
        run(_read(_kv_frame()[:-1]))

    assert caught.value.request_id == "req-7"


def test_flipped_payload_byte_raises_checksum_error(run) -> None:
    data = bytearray(_kv_frame())
    data[-10] ^= 0x01

    with pytest.raises(ChecksumError) as caught:
        run(_read(bytes(data)))

    assert caught.value.request_id == "req-7"


def test_flipped_header_byte_raises_checksum_error(run) -> None:
    data = bytearray(_kv_frame())
    data[9] ^= 0x01  # inside block_start

    with pytest.raises(ChecksumError):
        run(_read(bytes(data)))


def test_payload_above_the_limit_raises_oversize_without_reading_it(run) -> None:
    # Only the header is on the stream: the reader must refuse before waiting for the payload.
    header_only = _kv_frame(b"x" * 2048)[: HEADER_SIZE + len("req-7")]

    with pytest.raises(OversizeFrameError) as caught:
        run(_read(header_only, max_payload_bytes=1024))

    assert caught.value.request_id == "req-7"


def test_payload_at_the_limit_is_accepted(run) -> None:
    frame = run(_read(_kv_frame(b"x" * 1024), max_payload_bytes=1024))

    assert len(frame.payload) == 1024


@pytest.mark.parametrize(
    ("request_id", "ranges"),
    [
        ("", {}),
        ("x" * 257, {}),
        ("r", {"block_start": 5, "block_end": 4}),
        ("r", {"token_start": 9, "token_end": 8}),
        ("r", {"block_end": 2**32}),
        ("r", {"token_start": -1}),
    ],
)
def test_encode_rejects_invalid_fields(request_id: str, ranges: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        encode_frame(FrameKind.KV_BLOCKS, request_id, b"", **ranges)


def test_tokens_payload_that_is_not_uint32s_is_malformed() -> None:
    with pytest.raises(MalformedFrameError):
        decode_token_ids(b"\x00\x01\x02")
