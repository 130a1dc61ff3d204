"""The token coder's per-row work compiled by numba: the integers of probability.py's numpy
definition (docs/format/RANGE_CODER.md §1), without its float64 copies and temporaries.

The numpy definition is about fifteen whole-row operations, each a temporary of V elements
(a float64 copy of the logits, steps, weights, shares, a cumulative table...): on a
256,000-token vocabulary that was a third of `seq`'s encode time (docs/BENCHMARKS.md, "Large
vocabularies"). Here a row is one pass over its logits into int32 steps (its maximum is
numpy's), then three over the steps: their weight sum, the first symbol of step 0, the
shares into the output; nothing else of V elements. The decoder's symbol search is one pass
that stops at the symbol, instead of a cumulative table and a binary search. probability.py
imports this module on first use and runs the numpy definition where numba is missing;
tests/codecs/test_rangecoder.py checks that both give the same integers.

Module-level functions, so numba's disk cache finds them in the next process (a closure over
another jitted function hashes differently in every process and would compile each time).
Exact: no fast-math, so ``(top - x) * log2e`` is the definition's IEEE binary64 subtraction
and multiplication; the rest is int64 arithmetic. The definition's constants come in as
arguments (probability.py holds them; importing it here would be a cycle).
"""

from __future__ import annotations

import numpy as np
from numba import njit

_FLAGS = {"cache": True, "nogil": True}


@njit(**_FLAGS)
def row_frequencies(x, top, spare, floor, weights, log2e, table_from, steps, shares, out):
    """One row of logits (V,) into its frequencies `out` (int64, V).

    `top` is the row's maximum (finite: the caller takes it with numpy, whose SIMD maximum
    also tells NaN, +inf and all -inf, the rows the definition refuses), `weights[s]` the
    weight of step s (0..MAX_STEPS), `log2e` the definition's K; `steps` (int32, V) and
    `shares` (int64, MAX_STEPS + 1) are scratch. Passes, each a plain loop (a test inside
    one kept it scalar: 2.4x slower): every step; their weight sum; the first symbol of
    step 0 (it stops there); the shares. A division costs ~5 ns, so from `table_from`
    symbols on the share of every possible step is computed once and looked up, instead of
    one division per symbol."""
    n = x.shape[0]
    max_steps = weights.shape[0] - 1
    for i in range(n):
        y = (top - np.float64(x[i])) * log2e  # >= 0; a -inf logit gives +inf
        steps[i] = np.int32(min(y, max_steps))
    total = 0
    for i in range(n):
        total += weights[steps[i]]
    first = 0
    while steps[first] != 0:  # the maximum itself has step 0
        first += 1
    shared = 0
    if n >= table_from:
        for j in range(max_steps + 1):
            shares[j] = weights[j] * spare // total
        for i in range(n):
            q = shares[steps[i]]
            shared += q
            out[i] = q + floor
    else:
        for i in range(n):
            q = weights[steps[i]] * spare // total
            shared += q
            out[i] = q + floor
    out[first] += spare - shared


@njit(**_FLAGS)
def frequencies(x, tops, spare, floor, weights, log2e, table_from, steps, shares, out):
    """Every row of x (M, V) into out (M, V); `tops` (M,) the rows' maxima."""
    for r in range(x.shape[0]):
        row_frequencies(
            x[r], tops[r], spare, floor, weights, log2e, table_from, steps, shares, out[r]
        )


@njit(**_FLAGS)
def intervals(
    x, tops, symbols, spare, floor, weights, log2e, table_from, steps, shares, row, low, freq
):
    """(cum_low, freq) of symbols[r] under the frequencies of row r of x; `row` is scratch."""
    for r in range(x.shape[0]):
        row_frequencies(x[r], tops[r], spare, floor, weights, log2e, table_from, steps, shares, row)
        s = symbols[r]
        below = 0
        for i in range(s):
            below += row[i]
        low[r] = below
        freq[r] = row[s]


@njit(**_FLAGS)
def symbol_at(row, target):
    """(s, cdf[s]) with cdf[s] <= target < cdf[s + 1]: the symbol that searchsorted(cdf,
    target, "right") - 1 picks (a zero frequency is never picked); (-1, total) when target
    is past the row's total."""
    below = 0
    for s in range(row.shape[0]):
        above = below + row[s]
        if target < above:
            return s, below
        below = above
    return -1, below
