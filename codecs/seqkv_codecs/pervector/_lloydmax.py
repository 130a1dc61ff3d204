"""Lloyd-Max scalar quantizers for the standard normal distribution, computed on first use.

TurboQuant rotates each vector so that its normalised coordinates are close to N(0, 1), where
the optimal fixed scalar quantizer is the Lloyd-Max one. The tables come from Lloyd iterations
on the exact Gaussian density (closed-form cell means), started from equal-probability cells and
run to a fixed point, then rounded to float32 so that last-ulp differences of ``math.erf``
between platforms cannot change a decoded value.
"""

from __future__ import annotations

import math
from functools import cache
from itertools import pairwise

import numpy as np


def _pdf(t: float) -> float:
    return math.exp(-0.5 * t * t) / math.sqrt(2.0 * math.pi) if math.isfinite(t) else 0.0


def _cdf(t: float) -> float:
    return 0.5 * (1.0 + math.erf(t / math.sqrt(2.0)))


def lloyd_max_gaussian(bits: int, tol: float = 1e-13) -> tuple[np.ndarray, float]:
    """Centroids (float32, ascending) of the ``2**bits``-level quantizer and its MSE per unit
    variance (0.3634, 0.1175, 0.03454, 0.009497 for 1..4 bits)."""
    levels = 2**bits
    centroids = [math.sqrt(2.0) * _inv_erf(2.0 * (i + 0.5) / levels - 1.0) for i in range(levels)]
    for _ in range(100_000):  # converges linearly; the cap only guards against a float cycle
        edges = [-math.inf, *((a + b) / 2 for a, b in pairwise(centroids)), math.inf]
        previous, centroids = (
            centroids,
            [(_pdf(lo) - _pdf(hi)) / (_cdf(hi) - _cdf(lo)) for lo, hi in pairwise(edges)],
        )
        if max(abs(a - b) for a, b in zip(centroids, previous, strict=True)) < tol:
            break
    edges = [-math.inf, *((a + b) / 2 for a, b in pairwise(centroids)), math.inf]
    # E[(X - c)^2 | cell] summed: E[X^2] - sum_k P_k c_k^2, since c_k is the cell mean
    mse = 1.0 - sum(
        (_cdf(hi) - _cdf(lo)) * c * c
        for c, (lo, hi) in zip(centroids, pairwise(edges), strict=True)
    )
    return np.array(centroids, dtype=np.float32), mse


def _inv_erf(y: float) -> float:
    """Inverse error function by Newton steps (only seeds the iteration, so precision is moot)."""
    x = 0.0
    for _ in range(60):
        x -= (math.erf(x) - y) / (2.0 / math.sqrt(math.pi) * math.exp(-x * x))
    return x


@cache
def centroids(bits: int) -> np.ndarray:
    """The float32 centroids for ``bits`` (computed on first use, ~25 ms, then cached)."""
    table = lloyd_max_gaussian(bits)[0]
    table.flags.writeable = False
    return table


@cache
def distortion(bits: int) -> float:
    """MSE per unit variance of the ``bits`` quantizer on N(0, 1)."""
    return lloyd_max_gaussian(bits)[1]
