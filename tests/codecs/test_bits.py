"""The one bit writer and reader: known bytes in both orders, round trips, and refusals."""

from __future__ import annotations

import numpy as np
import pytest

from seqkv_codecs.bits import BLOCK, BitReader, BitWriter, bit_length
from seqkv_codecs.errors import CorruptStreamError


@pytest.mark.parametrize(("order", "byte"), [("lsb", 0b1101), ("msb", 0b10110000)])
def test_bits_1011_in_either_order(order, byte):
    writer = BitWriter(order)
    writer.fixed(np.array([1, 0, 1, 1]), 1)
    assert writer.getvalue() == bytes([byte])
    reader = BitReader(bytes([byte]), order, "demo bits")
    assert reader.fixed(4, 1).tolist() == [1, 0, 1, 1]
    reader.finish()


@pytest.mark.parametrize(
    ("order", "data"),
    [
        # 5 in 3 bits, 1 in 2 bits, then unary 2 (0 0 1) and 0 (1)
        ("lsb", bytes([0b10001101, 0b1])),  # stream 1 0 1 | 1 0 | 0 0 1 | 1
        ("msb", bytes([0b10101001, 0b10000000])),  # stream 1 0 1 | 0 1 | 0 0 1 | 1
    ],
)
def test_fields_and_unary_codes_against_known_bytes(order, data):
    writer = BitWriter(order)
    writer.varying(np.array([5, 1]), np.array([3, 2]))
    writer.unary(np.array([2, 0]))
    assert writer.getvalue() == data
    reader = BitReader(data, order, "demo bits")
    assert reader.varying(np.array([3, 2])).tolist() == [5, 1]
    assert reader.unary(2).tolist() == [2, 0]
    reader.finish()


@pytest.mark.parametrize("order", ["lsb", "msb"])
def test_round_trip_of_wide_values_over_many_blocks(order):
    rng = np.random.default_rng(7)
    n = 2 * BLOCK + 5
    values = rng.integers(0, 2**63, n, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    widths = rng.integers(0, 65, n)
    gaps = rng.integers(0, 40, n)
    small = rng.integers(0, 2**40, n).astype(np.uint64)
    writer = BitWriter(order)
    writer.varying(values, widths)
    writer.unary(gaps)
    writer.gamma(small)
    writer.fixed(values, 64)
    data = writer.getvalue()
    reader = BitReader(data, order, "demo bits")
    mask = np.where(widths == 64, ~np.uint64(0), (np.uint64(1) << widths.astype(np.uint64)) - 1)
    np.testing.assert_array_equal(reader.varying(widths), values & mask)
    np.testing.assert_array_equal(reader.unary(n), gaps)
    np.testing.assert_array_equal(reader.gamma(n, max_length=40), small)
    np.testing.assert_array_equal(reader.fixed(n, 64), values)
    reader.finish()


def test_bit_length():
    values = np.array([0, 1, 2, 3, 255, 256, 2**40, 2**64 - 1], np.uint64)
    assert bit_length(values).tolist() == [0, 1, 2, 2, 8, 9, 41, 64]


@pytest.mark.parametrize("order", ["lsb", "msb"])
def test_reading_past_the_end_is_refused(order):
    reader = BitReader(b"\xff", order, "demo bits")
    reader.fixed(1, 6)
    with pytest.raises(CorruptStreamError, match="demo bits end early"):
        reader.fixed(1, 3)
    with pytest.raises(CorruptStreamError, match="demo bits end inside a gap"):
        BitReader(b"\x00", order, "demo bits").unary(1)


def test_a_reader_bounded_by_a_block_refuses_more():
    data = bytes([0xFF, 0xFF, 0xFF])
    reader = BitReader(data, "msb", "demo bits", start=1, size=1)
    assert reader.fixed(1, 8).tolist() == [0xFF]
    with pytest.raises(CorruptStreamError, match="end early"):
        reader.fixed(1, 1)
    with pytest.raises(CorruptStreamError, match="end early"):
        BitReader(data, "msb", "demo bits", start=2, size=2)


def test_padding_and_trailing_bits_are_refused():
    reader = BitReader(bytes([0b10110001]), "msb", "demo bits")
    reader.fixed(4, 1)
    with pytest.raises(CorruptStreamError, match="nonzero padding"):
        reader.finish()
    reader = BitReader(bytes([0b1, 0]), "lsb", "demo bits")
    reader.fixed(1, 1)
    with pytest.raises(CorruptStreamError, match="15 trailing bits"):
        reader.finish()
    with pytest.raises(CorruptStreamError, match="longer than 3 bits"):
        BitReader(bytes([0b00010000]), "lsb", "demo bits").gamma(1, max_length=3)
    with pytest.raises(ValueError, match="'msb' or 'lsb'"):
        BitWriter("big")  # type: ignore[arg-type]
