"""Residuals between captured and recomputed K/V: exact (bit patterns) and bounded (EPS)."""

from __future__ import annotations

import numpy as np
import pytest

from seqkv_codecs.errors import CorruptStreamError
from seqkv_codecs.residual import apply_residual, encode_residual, is_empty
from seqkv_codecs.tolerance import apply_tolerance, encode_tolerance, to_bits, to_float


def near_copies(dtype: str, rate: float, seed: int = 0):
    """Captured values and a recomputation that is off in a `rate` share of elements."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((3, 300, 64)) * 2).astype(np.float32)
    noise = np.where(rng.random(x.shape) < rate, rng.standard_normal(x.shape) * 0.03, 1e-6)
    return to_bits(x, dtype), to_bits((x + noise).astype(np.float32), dtype)


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_exact_residual_restores_every_bit(dtype):
    captured, recomputed = near_copies(dtype, 0.01)
    data = encode_residual(captured, recomputed)
    assert np.array_equal(apply_residual(data, recomputed), captured)
    assert len(data) < captured.nbytes / 4  # sparse differences are cheap
    same = encode_residual(captured, captured)
    assert is_empty(same) and np.array_equal(apply_residual(same, captured), captured)


def test_exact_residual_extreme_patterns():
    captured = np.array([0, 0xFFFF, 0x7FC0, 0x8000], np.uint16)
    recomputed = np.array([0xFFFF, 0, 0x0001, 0x0000], np.uint16)
    assert np.array_equal(
        apply_residual(encode_residual(captured, recomputed), recomputed), captured
    )


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("eps", [1e-3, 1e-2, 0.2])
def test_tolerance_bound_always_holds(dtype, eps):
    captured, recomputed = near_copies(dtype, 0.05, seed=int(eps * 1000))
    data = encode_tolerance(captured, recomputed, dtype, eps)
    restored = apply_tolerance(data, recomputed, dtype)
    err = np.abs(to_float(restored, dtype).astype(np.float64) - to_float(captured, dtype))
    assert err.max() <= eps
    assert len(data) <= len(encode_residual(captured, recomputed))  # bounded costs <= exact


def test_tolerance_keeps_non_finite_values_exactly():
    captured = to_bits(np.array([np.nan, np.inf, -np.inf, 1.0], np.float32), "bf16")
    recomputed = to_bits(np.array([0.0, 1.0, 2.0, 1.0], np.float32), "bf16")
    restored = apply_tolerance(
        encode_tolerance(captured, recomputed, "bf16", 0.1), recomputed, "bf16"
    )
    assert np.array_equal(restored, captured)


def test_corrupt_residuals_raise():
    captured, recomputed = near_copies("bf16", 0.02)
    for data, apply in (
        (encode_residual(captured, recomputed), apply_residual),
        (
            encode_tolerance(captured, recomputed, "bf16", 1e-3),
            lambda d, r: apply_tolerance(d, r, "bf16"),
        ),
    ):
        for cut in (0, 5, len(data) // 2, len(data) - 1):
            with pytest.raises(CorruptStreamError):
                apply(data[:cut], recomputed)
        with pytest.raises(CorruptStreamError):
            apply(data, recomputed[:, :10])
