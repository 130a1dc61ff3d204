"""Exact repeats of whole (head, token) vectors, for the `lossless` codec.

The first layer's values are a function of the token alone (a projection of its embedding), so
every repeated token repeats its value vector bit for bit: about half the vectors of a
512-token text. A repeat is stored as a reference to an earlier vector instead of being coded
again.

A reference is an *ordinal*: the repeat copies the k-th vector of its head that was coded
(not itself a copy), counting from 0 in token order. Only vectors whose first occurrence is
among the first 65,536 tokens are referenced, so ordinals fit the entropy coder's alphabet.
"""

from __future__ import annotations

import numpy as np

MAX_ORDINAL = 1 << 16


def find_copies(bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For token-major bit patterns ``(S, H, D)``: a ``(S, H)`` copy mask and each copy's
    ordinal, copies listed in token-major order."""
    seq_len, heads, head_dim = bits.shape
    is_copy = np.zeros((seq_len, heads), dtype=bool)
    ordinals = np.zeros((seq_len, heads), dtype=np.int64)
    row_type = np.dtype((np.void, head_dim * bits.dtype.itemsize))
    for h in range(heads):
        rows = np.ascontiguousarray(bits[:, h]).view(row_type).reshape(seq_len)
        _, first, inverse = np.unique(rows, return_index=True, return_inverse=True)
        source = first[inverse.reshape(-1)]
        copy = (source < np.arange(seq_len)) & (source < MAX_ORDINAL)
        coded_before = np.cumsum(~copy) - 1  # ordinal of each coded row
        is_copy[:, h] = copy
        ordinals[:, h] = coded_before[source]
    return is_copy, ordinals[is_copy]
