"""Static probability model: symbol counts -> integer frequencies that sum to 2**precision.

The construction is part of the stream format: the decoder reads the frequencies, but any change
to how the encoder derives them from counts changes the bytes it writes, so it is integer-only
(no floats, no platform-dependent rounding) and fully specified in docs/format/ENTROPY_STREAM.md.
"""

from __future__ import annotations

import numpy as np

MIN_PRECISION = 14
MAX_PRECISION = 16  # a 32-bit state renormalised by 16-bit words needs precision <= 16


def choose_precision(n_present: int) -> int:
    """Precision for a table of ``n_present`` symbols (0 for empty and single-symbol streams).

    Measured on 16M skewed bytes: 12 bits loses ~0.007 bits/symbol to frequency rounding,
    16 bits ~0.004 to rANS rounding (the state is only 2**16..2**32); 14 loses ~0.002 in all.
    Larger alphabets keep four slots per distinct symbol so rare ones do not starve the rest.
    """
    if n_present <= 1:
        return 0
    need = int(n_present - 1).bit_length() + 2
    return min(MAX_PRECISION, max(MIN_PRECISION, need))


def table_from_counts(counts: np.ndarray) -> tuple[int, np.ndarray]:
    """(precision, frequencies) for symbol ``counts``; the whole model of a static stream."""
    precision = choose_precision(int(np.count_nonzero(counts)))
    return precision, normalize(counts, precision)


def normalize(counts: np.ndarray, precision: int) -> np.ndarray:
    """Frequencies (int64, 0 where absent) proportional to ``counts``, summing to 2**precision.

    Largest-remainder rounding with a floor of one: symbols whose share of the slots left over
    would round below one get exactly one slot and leave the pool, repeatedly until stable;
    the rest get ``floor(c * R / N)`` of the ``R`` remaining slots, and the ``R - sum`` slots
    still free go one each to the largest remainders ``c * R mod N`` (ties: smaller symbol).
    """
    counts = np.asarray(counts, dtype=np.int64)
    present = np.flatnonzero(counts)
    out = np.zeros(counts.size, dtype=np.int64)
    if present.size == 0:
        return out
    total = 1 << precision
    if present.size > total:
        raise ValueError(f"{present.size} distinct symbols do not fit in {precision}-bit precision")
    c = counts[present]
    ones = np.zeros(present.size, dtype=bool)
    while True:
        pool = total - int(ones.sum())
        mass = int(c[~ones].sum())
        grow = ~ones & (c * pool < mass)
        if not grow.any():
            break
        ones |= grow
    freqs = np.ones(present.size, dtype=np.int64)
    rest = np.flatnonzero(~ones)
    freqs[rest] = c[rest] * pool // mass
    spare = pool - int(freqs[rest].sum())
    if spare:
        remainder = c[rest] * pool % mass
        order = np.lexsort((rest, -remainder))
        freqs[rest[order[:spare]]] += 1
    out[present] = freqs
    return out


def encoder_table(freqs: np.ndarray) -> np.ndarray:
    """Per symbol: frequency in the low 16 bits, cumulative frequency in the high 16 bits."""
    return (freqs | ((np.cumsum(freqs) - freqs) << 16)).astype(np.uint32)


def decoder_tables(freqs: np.ndarray, precision: int) -> tuple[np.ndarray, np.ndarray]:
    """Per slot of ``2**precision``: the symbol, and frequency | (slot - cumulative) << 16."""
    present = np.flatnonzero(freqs)
    slot_sym = np.repeat(present, freqs[present])
    cum = np.cumsum(freqs) - freqs
    bias = np.arange(1 << precision) - cum[slot_sym]
    return slot_sym, (freqs[slot_sym] | (bias << 16)).astype(np.uint32)
