"""The numba code of `kernels`, compiled on first use (imported by `kernels` only then):
the quantizers, exp and scalings, and the per-value pieces the attention kernels
(`jitted_attention`) and the products over stored weights (`jitted_weights`) share.

Module-level functions, not closures: numba's disk cache keys a closure by its cells, and a
cell holding another jitted function hashes differently in every process (every run would
compile again, seconds each). Each kernel is one build whose outer loop runs a range
``first``..``stop`` of independent tasks (rows, or heads x rows): `kernels` runs ranges of them
on several threads. numba's own parallel builds are not used: they compiled twice as long,
and a new install's first command waited on them (docs/BENCHMARKS.md, first run).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from seqkv_cli.runtime import lanes

# elementary._EXP_TERMS, the exp polynomial's length: a constant count unrolls the Horner loop, so
# its callers vectorise. Were the two to differ, the canary's digest would refuse the kernels.
EXP_TERMS = 14

exact_flags = {"cache": True, "nogil": True}
# Only reassociation: it vectorises an integer-valued sum, which it cannot change.
sum_flags = {**exact_flags, "fastmath": {"reassoc"}}


GROUP = 4 * lanes.LANES  # elements one pass of four lane accumulators takes


# Inlined: called once a key in a step's attention (a head's 64 to 128 terms), a call and
# its array arguments cost three times the sum itself.
@njit(inline="always", **exact_flags)
def integer_dot(x, w):
    """Σ x·w of integer-valued rows (fp64, or fp32 w) whose every partial sum is below 2**53:
    exact in any order (four accumulators of four lanes, then the tail)."""
    n = x.shape[0]
    a0 = a1 = a2 = a3 = lanes.zeros()
    k = 0
    while k + GROUP <= n:
        a0 = lanes.fma(lanes.load(x, k), lanes.load(w, k), a0)
        a1 = lanes.fma(lanes.load(x, k + 4), lanes.load(w, k + 4), a1)
        a2 = lanes.fma(lanes.load(x, k + 8), lanes.load(w, k + 8), a2)
        a3 = lanes.fma(lanes.load(x, k + 12), lanes.load(w, k + 12), a3)
        k += GROUP
    acc = lanes.total((a0 + a1) + (a2 + a3))
    for t in range(k, n):
        acc += x[t] * w[t]
    return acc


# 2**e for every normal exponent: a table lookup vectorises where a libm call would not.
powers = np.ldexp(1.0, np.arange(-1022, 1024))


@njit(inline="always", **exact_flags)
def pow2(e):  # 2**e for integer e in [-1022, 1023]: exact, as exact.pow2
    return powers[e + 1022]


@njit(inline="always", **exact_flags)
def exp_parts(x0, coef, log2e, ln2_hi, ln2_lo, lo, hi):
    """elementary.exp's reduction of one value: (k, the polynomial of r), e**x0 = poly · 2**k."""
    x = lo if x0 < lo else (hi if x0 > hi else x0)  # torch.clamp; NaN stays NaN
    k = np.rint(x * log2e)
    r = (x - k * ln2_hi) - k * ln2_lo
    acc = coef[0]  # coef: Horner order, highest first
    for j in range(1, EXP_TERMS):  # a constant count: unrolled, so the caller vectorises
        acc = acc * r + coef[j]
    return k, acc


@njit(inline="always", **exact_flags)
def exp1(x0, coef, log2e, ln2_hi, ln2_lo, lo, hi):  # elementary.exp of one value, step for step
    k, acc = exp_parts(x0, coef, log2e, ln2_hi, ln2_lo, lo, hi)
    ki = np.int64(k) if k == k else 0  # NaN: any in-range index, the result is NaN anyway
    half = ki >> 1  # floor division by 2, as elementary.exp
    y = (acc * pow2(half)) * pow2(ki - half)
    return 0.0 if x0 == -math.inf else y


def exp(a, out, coef, log2e, ln2_hi, ln2_lo, lo, hi, first, stop):
    for i in range(first, stop):  # branch-free, so that it vectorises
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


def quantize(a, bits, l1, xq, ex, first, stop):  # a (M, K) -> xq (M, K), ex (M,)
    """exact.quantize_l1 (l1: ``bits`` are the right operand's) or exact.quantize_rows."""
    for m in range(first, stop):
        ex[m] = quantize_row(a[m], bits, l1, xq[m])


def split(a, bits, out, ex, first, stop):  # exact.split_rows of a (H, R, K): out (H, 2R, K)
    rows, k_len = a.shape[1], a.shape[2]  # ex (H, R)
    for t in range(first, stop):  # of heads * rows
        h = t // rows
        r = t - h * rows
        e = row_exponent(a[h, r], bits)
        ex[h, r] = e
        down, back, rest = pow2(-e), pow2(e), pow2(bits - e)
        for k in range(k_len):
            q = np.rint(a[h, r, k] * down)
            out[h, r, k] = q
            out[h, rows + r, k] = np.rint((a[h, r, k] - q * back) * rest)


def combine(s, erow, ecol, bits, out, first, stop):  # scale(s1, e) + scale(s2, e - bits)
    rows, n_cols = out.shape[1], out.shape[2]  # s (H, 2R, N): the limbs' sums; e = erow + ecol
    col = np.empty(n_cols)
    for n in range(n_cols):
        col[n] = pow2(ecol[n])
    for t in range(first, stop):  # of heads * rows
        h = t // rows
        r = t - h * rows
        # 2**e = 2**erow · 2**ecol exactly (every exponent here is normal, see
        # exact.quantize_rows' clamp), so the same multiplier as exact.scale's
        hi, lo = pow2(erow[h, r]), pow2(erow[h, r] - bits)
        for n in range(n_cols):
            out[h, r, n] = s[h, r, n] * (hi * col[n]) + s[h, rows + r, n] * (lo * col[n])


def scale_product(s, erow, ecol, out, first, stop):  # exact.fixed_matmul's scaling
    n_cols = out.shape[1]  # s (M, N) · 2**(erow + ecol)
    col = np.empty(n_cols)
    for n in range(n_cols):
        col[n] = pow2(ecol[n])
    for m in range(first, stop):  # of M
        row = pow2(erow[m])  # times col[n]: 2**(erow + ecol) exactly (normal, see combine)
        for n in range(n_cols):
            out[m, n] = s[m, n] * (row * col[n])


def rms_norm(h, weight, eps, out, first, stop):
    """fused.FusedDecoder._rms_norm of rows first..stop of h (M, K; fp32), step for step:
    squares rounded to fp32, their sum by elementary.tree_sum's fixed tree in fp64 (padded
    with zeros to a power of two), divided by K and rounded to fp32, plus eps in fp32,
    1/sqrt in fp64 rounded to fp32, then weight · (h · that) in fp32."""
    k_len = h.shape[1]
    width = 1
    while width < k_len:
        width *= 2
    buf = np.zeros(width)
    for m in range(first, stop):
        for k in range(k_len):
            a = np.float64(h[m, k])
            buf[k] = np.float64(np.float32(a * a))
        half = width // 2
        while half >= 1:
            for i in range(half):
                buf[i] = buf[i] + buf[i + half]
            half //= 2
        variance = np.float32(buf[0] / k_len)
        inv = np.float32(1.0 / np.sqrt(np.float64(variance + eps)))
        for k in range(k_len):  # the tree wrote below K only: the padding stays zero
            out[m, k] = weight[k] * (h[m, k] * inv)


def silu_product(gate, up, out, coef, log2e, ln2_hi, ln2_lo, lo, hi, first, stop):
    """elementary.silu(gate) · up over fp32 rows first..stop: gate / (1 + exp(-gate)) in
    fp64 (exp as elementary.exp) rounded to fp32, times up in fp32."""
    for m in range(first, stop):
        for k in range(gate.shape[1]):
            a = np.float64(gate[m, k])
            e = exp1(-a, coef, log2e, ln2_hi, ln2_lo, lo, hi)
            out[m, k] = np.float32(a / (1.0 + e)) * up[m, k]


KERNELS = {
    fn.__name__: njit(**exact_flags)(fn)
    for fn in (exp, quantize, split, combine, scale_product, rms_norm, silu_product)
}
