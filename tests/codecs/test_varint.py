"""The one varint codec: known bytes, round trips, and refusals of truncated or overlong input."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from seqkv_codecs.errors import CorruptStreamError
from seqkv_codecs.varint import (
    MAX_VARINT_BYTES,
    decode_varint,
    encode_varint,
    zigzag_decode,
    zigzag_encode,
)

KNOWN = [
    (0, "00"),
    (1, "01"),
    (127, "7f"),
    (128, "8001"),
    (300, "ac02"),
    (16383, "ff7f"),
    (16384, "808001"),
    ((1 << 32) - 1, "ffffffff0f"),
    ((1 << 64) - 1, "ffffffffffffffffff01"),
]


@pytest.mark.parametrize(("value", "hex_bytes"), KNOWN)
def test_known_encodings(value, hex_bytes):
    assert encode_varint(value) == bytes.fromhex(hex_bytes)
    assert decode_varint(bytes.fromhex(hex_bytes)) == (value, len(hex_bytes) // 2)


@given(st.integers(0, (1 << 70) - 1), st.binary(max_size=4), st.binary(max_size=4))
def test_round_trip_at_an_offset(value, before, after):
    data = before + encode_varint(value) + after
    assert decode_varint(data, len(before)) == (value, len(data) - len(after))


def test_padded_forms_are_read_up_to_the_byte_limit():
    assert decode_varint(b"\x80\x00") == (0, 2)
    assert decode_varint(b"\xff" * 9 + b"\x7f") == ((1 << 70) - 1, 10)  # 10 bytes: 70 bits
    with pytest.raises(CorruptStreamError, match="longer than 10 bytes"):
        decode_varint(b"\x80" * MAX_VARINT_BYTES + b"\x00")
    assert decode_varint(b"\x80" * 5 + b"\x01", max_bytes=6) == (1 << 35, 6)
    with pytest.raises(CorruptStreamError, match="longer than 6 bytes"):
        decode_varint(b"\x80" * 6 + b"\x01", max_bytes=6)


@pytest.mark.parametrize("data", [b"", b"\x80", b"\xff\xff", b"\x01\x80"])
def test_truncated_input_is_refused(data):
    with pytest.raises(CorruptStreamError, match="runs past the end"):
        decode_varint(data, len(data) - 1 if data == b"\x01\x80" else 0)


def test_negative_values_are_refused():
    with pytest.raises(ValueError, match="non-negative"):
        encode_varint(-1)


@given(st.integers(-(1 << 66), 1 << 66))
def test_zigzag_round_trip(value):
    z = zigzag_encode(value)
    assert z >= 0 and zigzag_decode(z) == value


def test_zigzag_order():
    assert [zigzag_encode(v) for v in (0, -1, 1, -2, 2)] == [0, 1, 2, 3, 4]
