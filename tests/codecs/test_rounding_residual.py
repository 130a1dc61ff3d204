"""The residual modelled on rounding (SKR2): exact on every pattern, smaller than SKR1 where a
cache differs from the recompute by another path's rounding noise, and strict about damage."""

from __future__ import annotations

import numpy as np
import pytest

from seqkv_codecs.errors import CorruptStreamError
from seqkv_codecs.residual import encode_residual
from seqkv_codecs.rounding_residual import (
    apply_rounding_residual,
    contexts,
    dtype_of,
    encode_rounding_residual,
    rounded_bits,
)
from seqkv_codecs.tolerance import to_bits


def foreign_cache(dtype: str, noise: float = 2e-4, seed: int = 0):
    """An unrounded recompute (rows of very different scales, as K/V heads have) and a cache
    of the same values from a path whose float32 results carry noise relative to each row."""
    rng = np.random.default_rng(seed)
    scale = np.exp(rng.normal(0, 2, (3, 200, 1)))
    exact = (rng.standard_normal((3, 200, 64)) * scale).astype(np.float32)
    row = np.abs(exact).max(axis=-1, keepdims=True)
    theirs = (exact + rng.standard_normal(exact.shape) * noise * row).astype(np.float32)
    return to_bits(theirs, dtype), exact


@pytest.mark.parametrize(
    ("dtype", "noise", "ratio"),  # noise about a twentieth of a step of the dtype
    [("bf16", 2e-4, 0.75), ("fp16", 2.5e-5, 0.75), ("fp32", 2e-6, 0.9)],
)
def test_restores_every_bit_and_beats_the_plain_difference(dtype, noise, ratio):
    captured, exact = foreign_cache(dtype, noise)
    data = encode_rounding_residual(captured, exact, dtype)
    assert dtype_of(data) == dtype
    assert np.array_equal(apply_rounding_residual(data, exact, dtype), captured)
    plain = encode_residual(captured, rounded_bits(exact, dtype))
    assert len(data) < ratio * len(plain), (len(data), len(plain))


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_no_difference_is_the_header_alone(dtype):
    exact = np.random.default_rng(1).standard_normal((2, 5, 8)).astype(np.float32)
    data = encode_rounding_residual(rounded_bits(exact, dtype), exact, dtype)
    assert len(data) == 9  # magic, version 2, dtype, size coding, varints n = 80 and z = 0
    assert np.array_equal(apply_rounding_residual(data, exact, dtype), rounded_bits(exact, dtype))


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_any_pattern_against_any_recompute(dtype):
    """Unrelated bits, NaN/inf/zero rows in the recompute, differences of every size."""
    rng = np.random.default_rng(2)
    width = 2 if dtype != "fp32" else 4
    top = (1 << (8 * width)) - 1
    captured = rng.integers(0, top, (4, 6, 16), endpoint=True).astype(f"u{width}")
    captured.ravel()[:4] = [0, top, 1, top - 1]
    exact = rng.standard_normal((4, 6, 16)).astype(np.float32) * 1e3
    exact[0, 0] = 0.0
    exact[1, 1, :3] = [np.nan, np.inf, -np.inf]
    exact[2, 2] = 3e38  # overflows bf16/fp16 to inf
    exact[3, 3, 0] = 1e-40  # subnormal
    data = encode_rounding_residual(captured, exact, dtype)
    assert np.array_equal(apply_rounding_residual(data, exact, dtype), captured)


def test_contexts_follow_the_rounding_boundary_and_the_row():
    """The nearer neighbour and the distance to the boundary, relative to the row's scale."""
    # bf16 steps by 2**-7 in [1, 2): the boundary above 1.0 is 1 + 2**-8
    exact = np.array([[1.0 + 2**-8 - 2**-20, 1.0 + 2**-12, -(1.0 + 2**-8 + 2**-20), 0.5]])
    exact = exact.astype(np.float32)
    base, toward, ctx = contexts(exact, "bf16")
    assert list(base) == list(to_bits(exact, "bf16").ravel())
    assert list(toward) == [1, 1, -1, 1]
    # the row's largest |value| is just above 1: 2**-20 from the boundary is context 20;
    # 2**-8 - 2**-12 lies in [2**-9, 2**-8): 8; the exactly representable 0.5 lies half its
    # step (2**-9) from its boundary: 9
    assert list(ctx) == [20, 8, 20, 9]


def test_damage_is_refused():
    captured, exact = foreign_cache("bf16")
    data = encode_rounding_residual(captured, exact, "bf16")
    for cut in (0, 10, 30, len(data) // 2, len(data) - 1):
        with pytest.raises(CorruptStreamError):
            apply_rounding_residual(data[:cut], exact, "bf16")
    with pytest.raises(CorruptStreamError, match="trailing"):
        apply_rounding_residual(data + b"\x01", exact, "bf16")
    with pytest.raises(CorruptStreamError, match="for bf16, the session is fp16"):
        apply_rounding_residual(data, exact, "fp16")
    with pytest.raises(CorruptStreamError, match="does not match"):
        apply_rounding_residual(data, exact[:, :-1], "bf16")
    for offset in range(10):  # every header byte: magic, version, dtype, sizes, n (2 bytes), z
        bad = bytearray(data)
        bad[offset] ^= 0x40
        with pytest.raises(CorruptStreamError):
            apply_rounding_residual(bytes(bad), exact, "bf16")


def test_sizes_are_unary_for_a_few_steps_and_ranS_for_broad_differences():
    """Version 2 codes the bit lengths of the differences in unary where they are mostly one
    step (a bf16 cache near the recompute), and with a rANS table where they are broad (an
    fp32 cache, where every element differs by many steps); both restore every bit."""
    near, exact = foreign_cache("bf16", 1e-5)
    broad, exact32 = foreign_cache("fp32", 2e-6)
    for captured, recompute, dtype, sizes in (
        (near, exact, "bf16", 0),
        (broad, exact32, "fp32", 1),
    ):
        data = encode_rounding_residual(captured, recompute, dtype)
        assert data[4:7] == bytes([2, ["bf16", "fp16", "fp32"].index(dtype), sizes])
        assert np.array_equal(apply_rounding_residual(data, recompute, dtype), captured)


def test_hostile_numbers_are_refused():
    """A count whose bit length runs past what any stream holds, and a size coding that does
    not exist: refused, not allocated or guessed."""
    captured, exact = foreign_cache("bf16")
    data = encode_rounding_residual(captured, exact, "bf16")
    head = data[:7] + bytes([0x80, 0xAC, 0x02, 0x01])  # n = 38,400, z = 1
    with pytest.raises(CorruptStreamError):
        apply_rounding_residual(head + bytes(7) + b"\x01", exact, "bf16")
    with pytest.raises(CorruptStreamError, match="unknown size coding"):
        apply_rounding_residual(data[:6] + b"\x02" + data[7:], exact, "bf16")
