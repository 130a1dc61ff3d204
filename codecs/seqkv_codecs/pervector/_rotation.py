"""Seeded random rotations for TurboQuant-class codecs.

A random rotation spreads a vector's energy evenly over its coordinates, so each normalised
coordinate is close to N(0, 1) whatever the input (outlier channels included) and one fixed
Gaussian quantizer fits all of them. For power-of-two head_dim the rotation is a randomized
Hadamard transform (random signs, then the fast Walsh-Hadamard transform; O(d log d), nothing
to store); otherwise a seeded random orthogonal matrix (QR of a Gaussian matrix).
"""

from __future__ import annotations

import numpy as np

from seqkv_codecs.errors import CodecError

# A dense rotation costs d**2 floats and an O(d**3) QR: head_dim beyond this is refused (an
# encoder never meets one; a crafted stream declaring 65521 would take minutes and 34 GB).
MAX_DENSE_DIM = 1024


def fwht(x: np.ndarray) -> np.ndarray:
    """Unnormalised Walsh-Hadamard transform along the last axis (length a power of two)."""
    d = x.shape[-1]
    y = x.reshape(-1, d).copy()
    h = 1
    while h < d:
        y = y.reshape(-1, d // (2 * h), 2, h)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        y = np.stack((a + b, a - b), axis=2)
        h *= 2
    return y.reshape(x.shape)


class Rotation:
    """An orthogonal map of R^d fixed by ``seed`` (same seed, same map)."""

    def __init__(self, dim: int, seed: int) -> None:
        rng = np.random.default_rng([seed, dim])
        self.dim = dim
        self.hadamard = dim > 0 and dim & (dim - 1) == 0
        if self.hadamard:
            self._signs = np.where(rng.integers(0, 2, dim) == 1, 1.0, -1.0)
        else:
            if dim > MAX_DENSE_DIM:
                raise CodecError(
                    f"head_dim {dim} is not a power of two and over {MAX_DENSE_DIM}: "
                    "no dense rotation is built for it"
                )
            q, r = np.linalg.qr(rng.standard_normal((dim, dim)))
            self._matrix = q * np.where(np.diag(r) < 0, -1.0, 1.0)  # unique: Haar-distributed

    def apply(self, x: np.ndarray) -> np.ndarray:
        """Rotate vectors along the last axis (float64)."""
        if self.hadamard:
            return fwht(x * self._signs) / np.sqrt(self.dim)
        return x @ self._matrix

    def invert(self, y: np.ndarray) -> np.ndarray:
        """Undo `apply`."""
        if self.hadamard:
            return fwht(y) / np.sqrt(self.dim) * self._signs
        return y @ self._matrix.T
