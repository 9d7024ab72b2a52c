"""Packed token ids (pdd.token_ids): the data plane's compact form of a prompt."""

from __future__ import annotations

import base64

import pytest

from pdd.token_ids import from_wire, packed_u32, to_wire


def test_packed_ids_round_trip_as_little_endian_32_bit_words():
    ids = [0, 1, 255, 256, 151_935, 2**32 - 1]
    text = to_wire(ids)
    assert from_wire(text) == ids
    assert base64.b64decode(text)[:8] == b"\x00\x00\x00\x00\x01\x00\x00\x00"
    assert packed_u32([1, 2]) == b"\x01\x00\x00\x00\x02\x00\x00\x00"
    assert from_wire(to_wire([])) == []


@pytest.mark.parametrize(
    ("text", "says"),
    [("AQAAAA!=", "base64"), ("AQA", "base64"), ("AQAA", "3 bytes")],
)
def test_a_bad_packed_string_is_a_value_error_saying_why(text, says):
    with pytest.raises(ValueError, match=says):
        from_wire(text)


def test_ids_outside_32_bits_cannot_be_packed():
    with pytest.raises(OverflowError):
        to_wire([-1])
    with pytest.raises(OverflowError):
        to_wire([2**32])
