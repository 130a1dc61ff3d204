"""`SKS1`: a capture's own float64 surprisal against the recompute's, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from seqkv_codecs.errors import CorruptStreamError
from seqkv_codecs.surprisal_delta import apply_surprisal_delta, encode_surprisal_delta
from seqkv_codecs.varint import encode_varint


def noisy(n: int, rel: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(a capture's surprisal, the recompute's): the same values up to `rel` relative noise."""
    rng = np.random.default_rng(seed)
    recomputed = np.abs(rng.standard_normal(n)) * 4 + 1e-3
    return recomputed * (1 + rng.standard_normal(n) * rel), recomputed


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return np.array_equal(np.asarray(a, "<f8").view("<u8"), np.asarray(b, "<f8").view("<u8"))


@pytest.mark.parametrize(("rel", "most_bits"), [(1e-7, 36), (1e-5, 43), (0.0, 0.5)])
def test_a_near_copy_costs_its_noise_not_64_bits(rel, most_bits):
    stored, recomputed = noisy(1000, rel)
    data = encode_surprisal_delta(stored, recomputed)
    assert same_bits(apply_surprisal_delta(data, recomputed), stored)
    assert len(data) * 8 / 1000 <= most_bits, len(data)


def test_the_layout_is_what_docs_format_md_specifies():
    recomputed = np.array([1.0, 2.0, 3.0])
    bits = recomputed.view("<u8").copy()
    bits += np.array([0, 3, 2**64 - 2], np.uint64)  # differences 0, +3, -2
    # zigzag 0, 6, 3 -> bit lengths 0, 3, 2: L_min 0, w 2; low bits: none, "10", "1"
    data = encode_surprisal_delta(bits.view("<f8"), recomputed)
    assert data == b"SKS1" + bytes([3, 0, 2]) + bytes([0b00_11_10_00, 0b10_1_00000])


@settings(max_examples=300, deadline=None)
@given(
    arrays(np.uint64, st.integers(0, 40), elements=st.integers(0, 2**64 - 1)),
    st.integers(0, 2**64 - 1),
)
def test_any_bit_patterns_come_back_exactly(patterns, offset):
    """NaN payloads, infinities, -0.0 and values far from the recompute included."""
    stored = patterns.view("<f8")
    recomputed = (patterns + np.uint64(offset)).view("<f8")
    data = encode_surprisal_delta(stored, recomputed)
    assert same_bits(apply_surprisal_delta(data, recomputed), stored)


def test_every_truncation_and_every_extra_byte_is_refused():
    stored, recomputed = noisy(50, 1e-7)
    data = encode_surprisal_delta(stored, recomputed)
    for cut in range(len(data)):
        with pytest.raises(CorruptStreamError):
            apply_surprisal_delta(data[:cut], recomputed)
    with pytest.raises(CorruptStreamError, match="1 bytes follow"):
        apply_surprisal_delta(data + b"\x00", recomputed)


def test_bit_flips_are_refused_or_change_the_values():
    stored, recomputed = noisy(40, 1e-7)
    data = encode_surprisal_delta(stored, recomputed)
    for bit in range(len(data) * 8):
        damaged = bytearray(data)
        damaged[bit // 8] ^= 1 << (bit % 8)
        try:
            out = apply_surprisal_delta(bytes(damaged), recomputed)
        except CorruptStreamError:
            continue
        assert not same_bits(out, stored), bit


@pytest.mark.parametrize(
    ("header", "words"),
    [
        (b"SKS2", "not a surprisal stream"),
        (b"SKS1" + encode_varint(4), "holds 4 values, not 3"),
        (b"SKS1" + encode_varint(3) + bytes([0, 8]), "are bad"),
        (b"SKS1" + encode_varint(3) + bytes([65, 0]), "are bad"),
        (b"SKS1" + encode_varint(3) + bytes([64, 1]) + b"\xe0", "longer than 64 bits"),
        (b"SKS1" + encode_varint(3) + bytes([0, 1]) + b"\x01", "nonzero padding"),
        (b"SKS1\x80", "ends inside its count"),
    ],
)
def test_hostile_headers_get_one_line_each(header, words):
    with pytest.raises(CorruptStreamError, match=words):
        apply_surprisal_delta(header, np.array([1.0, 2.0, 3.0]))
