"""Packed token ids (format 1.7): exact round trips, the documented bytes, and every damaged
stream refused as CorruptStreamError."""

from __future__ import annotations

import numpy as np
import pytest

from seqkv_codecs.entropy import encode_symbols
from seqkv_codecs.errors import CorruptStreamError
from seqkv_codecs.packed_ids import is_packed, pack_ids, unpack_ids


def test_the_documented_example():
    assert pack_ids(np.array([3, 0, 5])) == bytes.fromhex("50 03 03 43 01")


@pytest.mark.parametrize("top", [1, 2, 255, 256, 49_151, 151_935, 2**32 - 1])
def test_round_trips_at_the_width_of_the_largest_id(top):
    rng = np.random.default_rng(top)
    ids = rng.integers(0, top + 1, size=97)
    ids[13] = top
    data = pack_ids(ids)
    width = max(1, top.bit_length())
    assert len(data) == 1 + 1 + 1 + -(-97 * width // 8) and data[2] == width
    assert np.array_equal(unpack_ids(data, 97), ids)


def test_an_agents_turn_is_smaller_packed_than_under_a_static_table():
    ids = np.random.default_rng(0).integers(0, 49_152, size=100)
    assert len(pack_ids(ids)) == 203 < len(encode_symbols(ids, 49_152))
    assert not is_packed(encode_symbols(ids, 49_152))  # entropy streams start 1 or 2


def test_every_damaged_stream_is_refused():
    data = pack_ids(np.arange(21) * 3)  # 21 ids of 6 bits: 16 bytes, 2 bits of padding
    for size in range(len(data)):
        with pytest.raises(CorruptStreamError):
            unpack_ids(data[:size], 21)
    for damaged in (
        data + b"\x00",  # a byte too many
        data[:1] + b"\x16" + data[2:],  # 22 ids claimed, 21 allowed
        data[:2] + b"\x00" + data[3:],  # width 0
        data[:2] + b"\x21" + data[3:],  # width 33
        data[:-1] + bytes([data[-1] | 0x80]),  # a bit past the last id
    ):
        with pytest.raises(CorruptStreamError):
            unpack_ids(damaged, 21)
    with pytest.raises(ValueError, match="must lie in"):
        pack_ids(np.array([-1]))
