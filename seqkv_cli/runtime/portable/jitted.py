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


@njit(**sum_flags)
def int_dot(x, hi, lo):  # x · W over one weight row: integer terms, exact in any order
    acc = 0.0
    for k in range(x.shape[0]):
        acc += x[k] * (hi[k] * 256.0 + lo[k])  # W exact: |W| <= 2**23
    return acc


@njit(**sum_flags)
def int_dot2(x0, x1, hi, lo):  # two rows against one weight row (read once, kept in L1)
    a0 = 0.0
    a1 = 0.0
    for k in range(x0.shape[0]):
        wk = hi[k] * 256.0 + lo[k]
        a0 += x0[k] * wk
        a1 += x1[k] * wk
    return a0, a1


@njit(inline="always", **exact_flags)
def row_products(x, hi, lo, n, out, scale, col):
    """Every row of x (M, K) against weight row n, two at a time: out[m, n] = the integer
    sum · (scale[m] · col), powers of two (exact: 1.0 leaves the sum as it is)."""
    m_rows = x.shape[0]
    pairs = m_rows - m_rows % 2
    for m in range(0, pairs, 2):
        a0, a1 = int_dot2(x[m], x[m + 1], hi[n], lo[n])
        out[m, n] = a0 * (scale[m] * col)
        out[m + 1, n] = a1 * (scale[m + 1] * col)
    if pairs < m_rows:  # an odd last row (a v3 step is one)
        out[pairs, n] = int_dot(x[pairs], hi[n], lo[n]) * (scale[pairs] * col)


def products(x, hi, lo, out):  # x (M, K) f64 integers, W = hi·256 + lo (N, K): the sums
    ones = np.ones(x.shape[0])
    for n in prange(hi.shape[0]):
        row_products(x, hi, lo, n, out, ones, 1.0)


# 2**e for every normal exponent: a table lookup vectorises where a libm call would not.
powers = np.ldexp(1.0, np.arange(-1022, 1024))


@njit(inline="always", **exact_flags)
def pow2(e):  # 2**e for integer e in [-1022, 1023]: exact, as exact.pow2
    return powers[e + 1022]


@njit(inline="always", **exact_flags)
def exp_parts(x0, coef, log2e, ln2_hi, ln2_lo, lo, hi):
    """exact.exp's reduction of one value: (k, the polynomial of r) with e**x0 = poly · 2**k."""
    x = lo if x0 < lo else (hi if x0 > hi else x0)  # torch.clamp; NaN stays NaN
    k = np.rint(x * log2e)
    r = (x - k * ln2_hi) - k * ln2_lo
    acc = coef[0]  # coef: Horner order, highest first
    for j in range(1, EXP_TERMS):  # a constant count: unrolled, so the caller vectorises
        acc = acc * r + coef[j]
    return k, acc


@njit(inline="always", **exact_flags)
def exp1(x0, coef, log2e, ln2_hi, ln2_lo, lo, hi):  # exact.exp of one value, step for step
    k, acc = exp_parts(x0, coef, log2e, ln2_hi, ln2_lo, lo, hi)
    ki = np.int64(k) if k == k else 0  # NaN: any in-range index, the result is NaN anyway
    half = ki >> 1  # floor division by 2, as exact.exp
    y = (acc * pow2(half)) * pow2(ki - half)
    return 0.0 if x0 == -math.inf else y


def exp(a, out, coef, log2e, ln2_hi, ln2_lo, lo, hi):
    for i in prange(a.shape[0]):  # branch-free, so that it vectorises
        out[i] = exp1(a[i], coef, log2e, ln2_hi, ln2_lo, lo, hi)


# No NaN (the caller checks first): the max is then order-free, which these flags let LLVM
# use to vectorise it (the sign of a zero does not matter: the peaks are of |x|, or a zero
# peak of scores changes no numerator).
@njit(**exact_flags, fastmath={"reassoc", "nnan", "nsz"})
def nan_free_abs_peak(v):
    peak = 0.0
    for x in v:
        peak = max(peak, abs(x))
    return peak


@njit(**exact_flags)
def has_nan(v):
    found = False
    for x in v:
        found |= x != x
    return found


@njit(**exact_flags)
def abs_peak(row):  # max |x| of a row; NaN if it holds one (as torch's amax)
    return math.nan if has_nan(row) else nan_free_abs_peak(row)


@njit(**exact_flags)
def peak_exponent(row):  # exact.quantize_rows' clamped exponent of a row's peak
    peak = abs_peak(row)
    # frexp(0) = (0, 0); a non-finite peak: glibc's frexp gives exponent 0 as well
    e = 0 if peak == 0.0 or not np.isfinite(peak) else math.frexp(peak)[1]
    return min(max(e, -450), 450)


@njit(**exact_flags)
def row_exponent(row, bits):  # exact.quantize_rows' e for one row
    return peak_exponent(row) - bits


L1_UNIT = 30  # exact.L1_UNIT


@njit(**sum_flags)
def l1_units(row, e_peak):  # exact.quantize_l1's U: integer-valued terms, exact in any order
    s = pow2(L1_UNIT - e_peak)
    acc = 0.0
    for v in row:
        acc += np.ceil(abs(v) * s)
    return acc


@njit(**exact_flags)
def l1_exponent(row, right):  # exact.quantize_l1's e for one row
    e_peak = peak_exponent(row)
    units = l1_units(row, e_peak)
    length = 0 if units == 0.0 or not np.isfinite(units) else math.frexp(units)[1]
    return e_peak + length - L1_UNIT - (52 - right)


@njit(inline="always", **exact_flags)
def quantize_row(row, bits, l1, out):  # one row of `quantize` into out; returns its exponent
    e = l1_exponent(row, bits) if l1 else row_exponent(row, bits)
    down = pow2(-e)
    for k in range(row.shape[0]):
        out[k] = np.rint(row[k] * down)
    return e


def quantize(a, bits, l1, xq, ex):  # a (M, K) -> xq (M, K), ex (M,)
    """exact.quantize_l1 (l1: ``bits`` are the right operand's) or exact.quantize_rows."""
    for m in prange(a.shape[0]):
        ex[m] = quantize_row(a[m], bits, l1, xq[m])


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


def step_products(x, right, l1, hi, lo, ew, out):
    """exact.kernel_product for one-integer forms in one call: each row of x (M, K; fp32 or
    fp64, M small) quantized as exact.quantize_l1 (l1) or quantize_rows, its integer sums
    with W = hi·256 + lo (N, K), scaled by 2**(ex + ew) as exact.fixed_matmul."""
    m_rows, k_len = x.shape
    xq = np.empty((m_rows, k_len))
    back = np.empty(m_rows)
    for m in range(m_rows):
        back[m] = pow2(quantize_row(x[m], right, l1, xq[m]))
    for n in prange(hi.shape[0]):
        # 2**(ex + ew) = 2**ex · 2**ew exactly, as combine
        row_products(xq, hi, lo, n, out, back, pow2(ew[n]))


def scale_product(s, erow, ecol, out):  # exact.fixed_matmul's scaling: s (M, N) · 2**(erow+ecol)
    m_rows, n_cols = out.shape
    col = np.empty(n_cols)
    for n in range(n_cols):
        col[n] = pow2(ecol[n])
    for m in prange(m_rows):
        row = pow2(erow[m])  # times col[n]: 2**(erow + ecol) exactly (normal, see combine)
        for n in range(n_cols):
            out[m, n] = s[m, n] * (row * col[n])


@njit(**sum_flags)
def integer_sum(v):  # integer-valued terms, sum below 2**53: exact in any order
    acc = 0.0
    for x in v:
        acc += x
    return acc


@njit(**exact_flags, fastmath={"reassoc", "nnan", "nsz"})
def nan_free_peak(v):  # as nan_free_abs_peak, of the values themselves
    peak = -math.inf
    for x in v:
        peak = max(peak, x)
    return peak


@njit(inline="always", **exact_flags)
def value_weights(buf, vscale, pb, coef, c1, c2, c3, c4, c5):
    """One query row's masked scores -> its softmax numerators (exp of score - max, rounded
    to 2**-pb), each times its key's value scale (vscale), in place; returns their sum.

    The same bits as `exp1` step by step, in passes LLVM vectorises: every score is <= the
    peak, so k <= 0, and where k + pb >= -1 the powers 2**half · 2**(k - half) · 2**pb are
    exact and equal 2**(k + pb), built here from its bits; below that both give 0 (the
    numerator rounds to 0 from under 2**-1), as does -inf.
    """
    n = buf.shape[0]
    peak = math.nan if has_nan(buf) else nan_free_peak(buf)  # amax propagates NaN
    acc = np.empty(n)
    power = np.empty(n, dtype=np.int64)
    for j in range(n):
        k, acc[j] = exp_parts(buf[j] - peak, coef, c1, c2, c3, c4, c5)
        m = k + pb
        power[j] = (np.int64(m) + 1023) << 52 if m >= -1.0 else 0  # NaN: 0 as well
    scale = power.view(np.float64)  # 2**(k + pb), or 0.0
    for j in range(n):
        buf[j] = np.rint(acc[j] * scale[j])  # NaN stays NaN (NaN · 0)
    total = integer_sum(buf)
    for j in range(n):
        buf[j] = buf[j] * vscale[j]
    return total


@njit(**exact_flags)
def powers_of(e):  # 2**e of an exponent table (H, n) -> fp64 (H, n)
    out = np.empty(e.shape)
    for h in range(e.shape[0]):
        for j in range(e.shape[1]):
            out[h, j] = pow2(e[h, j])
    return out


def softmax_weights(s, ex, ek, ev, qpos, spec, coef, c1, c2, c3, c4, c5, w, ew, total):
    """attention.attend between its two products, per (head, query row): the scores from
    the q·k integer sums, the causal/window mask, exp, the rounded numerators and their
    sum, each key's value scale folded in, and the weights split as `split_rows`."""
    heads, rows = ew.shape  # w (H, limbs·R, n): the weights' integers, limb by limb
    n = w.shape[2]
    kbits, vbits, pbits, window, form, scaling = spec
    kb, vb, pb, wnd = int(kbits), int(vbits), int(pbits), int(window)
    two, l1 = form == 2.0, form == 3.0  # exact.PEAK2, exact.L1
    kscale, vscale = powers_of(ek), powers_of(ev)
    for t in prange(heads * rows):
        h = t // rows
        r = t - h * rows
        # A private row (no aliasing with s or w for LLVM to fear), and each form's loops
        # apart, so that every pass vectorises; w is written once at the end.
        buf = np.empty(n)
        # 2**(ex + ek) = 2**ex · 2**ek exactly (normal: quantize_rows' clamp), as combine
        hi, lo, qp = pow2(ex[h, r]), pow2(ex[h, r] - kb), qpos[r]
        if two:
            for j in range(n):
                buf[j] = s[h, r, j] * (hi * kscale[h, j]) + s[h, rows + r, j] * (lo * kscale[h, j])
        else:
            for j in range(n):
                buf[j] = s[h, r, j] * (hi * kscale[h, j])
        for j in range(n):
            sc = buf[j] * scaling
            hidden = j > qp or (wnd >= 0 and qp - j >= wnd)
            buf[j] = -math.inf if hidden else sc
        total[h, r] = value_weights(buf, vscale[h], pb, coef, c1, c2, c3, c4, c5)
        e = l1_exponent(buf, vb) if l1 else row_exponent(buf, vb)
        ew[h, r] = e
        down, back, rest = pow2(-e), pow2(e), pow2(vb - e)
        out = w[h, r]
        if two:
            low = w[h, rows + r]
            for j in range(n):
                q = np.rint(buf[j] * down)
                low[j] = np.rint((buf[j] - q * back) * rest)
                out[j] = q
        else:
            for j in range(n):
                out[j] = np.rint(buf[j] * down)


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
    kbits, vbits, pbits, window, form, scaling = spec
    kb, vb, pb, wnd = int(kbits), int(vbits), int(pbits), int(window)
    two, l1 = form == 2.0, form == 3.0  # exact.PEAK2, exact.L1
    vscale = powers_of(ev[:, :n])
    for t in prange(heads * rows):
        h = t // rows
        r = t - h * rows
        x1 = np.empty(hd)
        x2 = np.zeros(hd)
        e = l1_exponent(q[h, r], kb) if l1 else row_exponent(q[h, r], kb)
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
        total = value_weights(buf, vscale[h], pb, coef, c1, c2, c3, c4, c5)
        ew = l1_exponent(buf, vb) if l1 else row_exponent(buf, vb)
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
    "scale_product": _both(scale_product, exact_flags),
    "step_products": _both(step_products, exact_flags),
    "softmax_weights": _both(softmax_weights, exact_flags),
    "attend_rows": _both(attend_rows, exact_flags),
}
