"""The numba code of `kernels`, compiled on first use (imported by `kernels` only then).

Module-level functions, not closures: numba's disk cache keys a closure by its cells, and a
cell holding another jitted function hashes differently in every process (every run would
compile again, seconds each). Each kernel comes as a serial and a parallel build.
"""

from __future__ import annotations

import math
import types

import numpy as np
from numba import njit, prange

# exact._EXP_TERMS, the exp polynomial's length: a constant count unrolls the Horner loop, so
# its callers vectorise. Were the two to differ, the canary's digest would refuse the kernels.
EXP_TERMS = 14

exact_flags = {"cache": True, "nogil": True}
# Only reassociation: it vectorises an integer-valued sum, which it cannot change.
sum_flags = {**exact_flags, "fastmath": {"reassoc"}}


def products(x, hi, lo, out):  # x (M, K) f64 integers (M even), W = hi·256 + lo (N, K)
    m_rows, k_len = x.shape
    for n in prange(hi.shape[0]):
        for m in range(0, m_rows, 2):  # two rows per pass: the weight row stays in L1
            a0 = 0.0
            a1 = 0.0
            for k in range(k_len):
                wk = hi[n, k] * 256.0 + lo[n, k]  # exact: |W| <= 2**23
                a0 += x[m, k] * wk
                a1 += x[m + 1, k] * wk
            out[m, n] = a0
            out[m + 1, n] = a1


# 2**e for every normal exponent: a table lookup vectorises where a libm call would not.
powers = np.ldexp(1.0, np.arange(-1022, 1024))


@njit(inline="always", **exact_flags)
def pow2(e):  # 2**e for integer e in [-1022, 1023]: exact, as exact.pow2
    return powers[e + 1022]


@njit(inline="always", **exact_flags)
def exp1(x0, coef, log2e, ln2_hi, ln2_lo, lo, hi):  # exact.exp of one value, step for step
    x = lo if x0 < lo else (hi if x0 > hi else x0)  # torch.clamp; NaN stays NaN
    k = np.rint(x * log2e)
    r = (x - k * ln2_hi) - k * ln2_lo
    acc = coef[0]  # coef: Horner order, highest first
    for j in range(1, EXP_TERMS):  # a constant count: unrolled, so the caller vectorises
        acc = acc * r + coef[j]
    ki = np.int64(k) if k == k else 0  # NaN: any in-range index, the result is NaN anyway
    half = ki >> 1  # floor division by 2, as exact.exp
    y = (acc * pow2(half)) * pow2(ki - half)
    return 0.0 if x0 == -math.inf else y


def exp(a, out, coef, log2e, ln2_hi, ln2_lo, lo, hi):
    for i in prange(a.shape[0]):  # branch-free, so that it vectorises
        out[i] = exp1(a[i], coef, log2e, ln2_hi, ln2_lo, lo, hi)


@njit(**exact_flags)
def row_exponent(row, bits):  # exact.quantize_rows' e for one row
    peak = 0.0
    for v in row:
        a = abs(v)
        if a > peak or a != a:  # amax propagates NaN
            peak = a
    # frexp(0) = (0, 0); a non-finite peak: glibc's frexp gives exponent 0 as well
    e = 0 if peak == 0.0 or not np.isfinite(peak) else math.frexp(peak)[1]
    return min(max(e, -450), 450) - bits


def quantize(a, bits, xq, ex):  # a (M, K) -> xq (M, K), ex (M,)
    for m in prange(a.shape[0]):
        e = row_exponent(a[m], bits)
        ex[m] = e
        s = pow2(-e)
        for k in range(a.shape[1]):
            xq[m, k] = np.rint(a[m, k] * s)


def split(a, bits, out, ex):  # exact.split_rows of a (H, R, K): out (H, 2R, K), ex (H, R)
    heads, rows, k_len = a.shape
    for t in prange(heads * rows):
        h = t // rows
        r = t - h * rows
        e = row_exponent(a[h, r], bits)
        ex[h, r] = e
        down, back, rest = pow2(-e), pow2(e), pow2(bits - e)
        for k in range(k_len):
            q = np.rint(a[h, r, k] * down)
            out[h, r, k] = q
            out[h, rows + r, k] = np.rint((a[h, r, k] - q * back) * rest)


def combine(s, erow, ecol, bits, out):  # scale(s1, e) + scale(s2, e - bits), e = erow+ecol
    heads, rows, n_cols = out.shape  # s (H, 2R, N): the two limbs' integer sums
    col = np.empty(n_cols)
    for n in range(n_cols):
        col[n] = pow2(ecol[n])
    for t in prange(heads * rows):
        h = t // rows
        r = t - h * rows
        # 2**e = 2**erow · 2**ecol exactly (every exponent here is normal, see
        # exact.quantize_rows' clamp), so the same multiplier as exact.scale's
        hi, lo = pow2(erow[h, r]), pow2(erow[h, r] - bits)
        for n in range(n_cols):
            out[h, r, n] = s[h, r, n] * (hi * col[n]) + s[h, rows + r, n] * (lo * col[n])


@njit(**sum_flags)
def integer_sum(v):  # integer-valued terms, sum below 2**53: exact in any order
    acc = 0.0
    for x in v:
        acc += x
    return acc


@njit(inline="always", **exact_flags)
def value_weights(buf, ev_row, pb, coef, c1, c2, c3, c4, c5):
    """One query row's masked scores -> its softmax numerators (exp of score - max, rounded
    to 2**-pb), each times its key's value scale, in place; returns the numerators' sum."""
    n = buf.shape[0]
    peak = -math.inf
    for j in range(n):
        if buf[j] > peak or buf[j] != buf[j]:  # amax propagates NaN
            peak = buf[j]
    unit = pow2(pb)
    for j in range(n):
        buf[j] = np.rint(exp1(buf[j] - peak, coef, c1, c2, c3, c4, c5) * unit)
    total = integer_sum(buf)
    for j in range(n):
        buf[j] = buf[j] * pow2(ev_row[j])
    return total


def softmax_weights(s, ex, ek, ev, qpos, spec, coef, c1, c2, c3, c4, c5, w, ew, total):
    """attention.attend between its two products, per (head, query row): the scores from
    the q·k integer sums, the causal/window mask, exp, the rounded numerators and their
    sum, each key's value scale folded in, and the weights split as `split_rows`."""
    heads, rows = ew.shape  # w (H, limbs·R, n): the weights' integers, limb by limb
    n = w.shape[2]
    kbits, vbits, pbits, window, limbs, scaling = spec
    kb, vb, pb, wnd, two = int(kbits), int(vbits), int(pbits), int(window), limbs == 2.0
    for t in prange(heads * rows):
        h = t // rows
        r = t - h * rows
        buf = w[h, r]  # scores, then weights, then their first limb: in the output row
        for j in range(n):  # loops without a carried sum, so that they vectorise
            e = ex[h, r] + ek[h, j]
            sc = s[h, r, j] * pow2(e)
            if two:
                sc = sc + s[h, rows + r, j] * pow2(e - kb)
            sc = sc * scaling
            hidden = j > qpos[r] or (wnd >= 0 and qpos[r] - j >= wnd)
            buf[j] = -math.inf if hidden else sc
        total[h, r] = value_weights(buf, ev[h], pb, coef, c1, c2, c3, c4, c5)
        e = row_exponent(buf, vb)
        ew[h, r] = e
        down, back, rest = pow2(-e), pow2(e), pow2(vb - e)
        for j in range(n):
            q = np.rint(buf[j] * down)
            if two:
                w[h, rows + r, j] = np.rint((buf[j] - q * back) * rest)
            buf[j] = q


@njit(inline="always", **sum_flags)
def dot(a, b):  # integer-valued terms, every partial sum below 2**53: exact in any order
    acc = 0.0
    for i in range(a.shape[0]):
        acc += a[i] * b[i]
    return acc


def attend_rows(q, kq, ek, vq, ev, n, qpos, spec, coef, c1, c2, c3, c4, c5, out):
    """attention.attend for a few query rows (a step), products included: per (head,
    row) the query's limbs, its integer sums with the first n keys, the softmax weights as
    `softmax_weights`, and their integer sums with the values, scaled and divided."""
    heads, rows, hd = out.shape
    kbits, vbits, pbits, window, limbs, scaling = spec
    kb, vb, pb, wnd, two = int(kbits), int(vbits), int(pbits), int(window), limbs == 2.0
    for t in prange(heads * rows):
        h = t // rows
        r = t - h * rows
        x1 = np.empty(hd)
        x2 = np.zeros(hd)
        e = row_exponent(q[h, r], kb)
        down, back, rest = pow2(-e), pow2(e), pow2(kb - e)
        for d in range(hd):
            x1[d] = np.rint(q[h, r, d] * down)
            x2[d] = np.rint((q[h, r, d] - x1[d] * back) * rest)
        buf = np.empty(n)
        for j in range(n):
            ej = e + ek[h, j]
            sc = dot(x1, kq[h, j]) * pow2(ej)
            if two:
                sc = sc + dot(x2, kq[h, j]) * pow2(ej - kb)
            sc = sc * scaling
            hidden = j > qpos[r] or (wnd >= 0 and qpos[r] - j >= wnd)
            buf[j] = -math.inf if hidden else sc
        total = value_weights(buf, ev[h], pb, coef, c1, c2, c3, c4, c5)
        ew = row_exponent(buf, vb)
        down, back, rest = pow2(-ew), pow2(ew), pow2(vb - ew)
        acc1 = np.zeros(hd)
        acc2 = np.zeros(hd)
        for j in range(n):  # integer sums again: any order is exact
            w1 = np.rint(buf[j] * down)
            w2 = np.rint((buf[j] - w1 * back) * rest) if two else 0.0
            for d in range(hd):
                acc1[d] += w1 * vq[h, j, d]
                acc2[d] += w2 * vq[h, j, d]
        hi, lo = pow2(ew), pow2(ew - vb)
        for d in range(hd):
            v = acc1[d] * hi + acc2[d] * lo if two else acc1[d] * hi
            out[h, r, d] = v / total


def _both(fn, flags):
    # Two function objects: numba's disk cache is keyed by the function's name, and a
    # serial and a parallel build under one name would evict each other on every run.
    parallel = types.FunctionType(
        fn.__code__, fn.__globals__, f"{fn.__name__}_parallel", None, fn.__closure__
    )
    parallel.__qualname__ = f"{fn.__qualname__}_parallel"
    return njit(**flags)(fn), njit(parallel=True, **flags)(parallel)


KERNELS = {
    "products": _both(products, sum_flags),
    "exp": _both(exp, exact_flags),
    "quantize": _both(quantize, exact_flags),
    "split": _both(split, exact_flags),
    "combine": _both(combine, exact_flags),
    "softmax_weights": _both(softmax_weights, exact_flags),
    "attend_rows": _both(attend_rows, exact_flags),
}
