"""The numba code of the attention kernels (`kernels.softmax_weights`, `kernels.attend_rows`,
`kernels.step_attention`): `attention.attend` between its two products, or a whole step's, per
(head, query row), and a step's rotary and cache write before it.

Built from `jitted`'s pieces (exp's reduction, the row exponents), so every value is the
reference's step for step; compiled on first use, like `jitted`.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from seqkv_cli.runtime.portable.jitted import (
    exact_flags,
    exp_parts,
    has_nan,
    integer_dot,
    l1_exponent,
    pow2,
    quantize_row,
    row_exponent,
    sum_flags,
)


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

    The same bits as `jitted.exp1` step by step, in passes LLVM vectorises: every score is <= the
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


def softmax_weights(s, ex, ek, ev, qpos, spec, coef, c1, c2, c3, c4, c5, w, ew, total, first, stop):
    """attention.attend between its two products, per (head, query row): the scores from
    the q·k integer sums, the causal/window mask, exp, the rounded numerators and their
    sum, each key's value scale folded in, and the weights split as `split_rows`."""
    rows = ew.shape[1]  # w (H, limbs·R, n): the weights' integers, limb by limb
    n = w.shape[2]
    kbits, vbits, pbits, window, form, scaling = spec
    kb, vb, pb, wnd = int(kbits), int(vbits), int(pbits), int(window)
    two, l1 = form == 2.0, form == 3.0  # exact.PEAK2, exact.L1
    kscale, vscale = powers_of(ek), powers_of(ev)
    for t in range(first, stop):  # of heads * rows
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


def attend_rows(q, kq, ek, vq, ev, n, qpos, spec, coef, c1, c2, c3, c4, c5, out, first, stop):
    """attention.attend for a few query rows (a step), products included: per (head,
    row) the query's limbs, its integer sums with the first n keys, the softmax weights as
    `softmax_weights`, and their integer sums with the values, scaled and divided."""
    rows, hd = out.shape[1], out.shape[2]
    kbits, vbits, pbits, window, form, scaling = spec
    kb, vb, pb, wnd = int(kbits), int(vbits), int(pbits), int(window)
    two, l1 = form == 2.0, form == 3.0  # exact.PEAK2, exact.L1
    vscale = np.empty(n)
    for t in range(first, stop):  # of heads * rows
        h = t // rows
        r = t - h * rows
        x1 = np.empty(hd)
        x2 = np.zeros(hd)
        e = l1_exponent(q[h, r], kb) if l1 else row_exponent(q[h, r], kb)
        down, back, rest = pow2(-e), pow2(e), pow2(kb - e)
        for d in range(hd):
            x1[d] = np.rint(q[h, r, d] * down)
            x2[d] = np.rint((q[h, r, d] - x1[d] * back) * rest)
        keys, kexp, vexp = kq[h], ek[h], ev[h]
        for j in range(n):
            vscale[j] = pow2(vexp[j])
        buf = np.empty(n)
        for j in range(n):
            ej = e + kexp[j]
            sc = integer_dot(x1, keys[j]) * pow2(ej)
            if two:
                sc = sc + integer_dot(x2, keys[j]) * pow2(ej - kb)
            sc = sc * scaling
            hidden = j > qpos[r] or (wnd >= 0 and qpos[r] - j >= wnd)
            buf[j] = -math.inf if hidden else sc
        total = value_weights(buf, vscale, pb, coef, c1, c2, c3, c4, c5)
        ew = l1_exponent(buf, vb) if l1 else row_exponent(buf, vb)
        down, back, rest = pow2(-ew), pow2(ew), pow2(vb - ew)
        acc1 = np.zeros(hd)
        acc2 = np.zeros(hd)
        values = vq[h]
        for j in range(n):  # integer sums again: any order is exact
            w1 = np.rint(buf[j] * down)
            value = values[j]
            for d in range(hd):
                acc1[d] += w1 * value[d]
            if two:  # v2's second limb; one-limb forms add nothing here
                w2 = np.rint((buf[j] - w1 * back) * rest)
                for d in range(hd):
                    acc2[d] += w2 * value[d]
        hi, lo = pow2(ew), pow2(ew - vb)
        for d in range(hd):
            v = acc1[d] * hi + acc2[d] * lo if two else acc1[d] * hi
            out[h, r, d] = v / total


@njit(inline="always", **exact_flags)
def rotated(x, cos, sin, d):  # element d of x·cos + rotate_half(x)·sin, in fp32 as x is
    half = x.shape[0] // 2
    r = -x[d + half] if d < half else x[d - half]
    return x[d] * cos[d] + r * sin[d]


def rotate_store(q, k, v, cos, sin, keys, values, kq, ek, vq, ev, p0, kbits, vbits, qout):
    """A step's rotary and K/V write for one sequence and layer, step for step as the fused
    decoder's numpy rows and `PortableState.write` do them: q (heads, hd) and k (kv_heads,
    hd) rotated in fp32 (``x·cos + rotate_half(x)·sin``, each product and the sum rounded to
    fp32), the rotated keys and the values written at position p0 of the layer's cache with
    their integers and exponents (`exact.quantize_rows`), and the rotated queries into qout
    as fp64 (kv_heads, groups, hd): what `attend_rows` reads."""
    kvh, hd = k.shape
    groups = q.shape[0] // kvh
    row = np.empty(hd, dtype=np.float32)
    ints = np.empty(hd)
    for h in range(kvh):
        for d in range(hd):
            row[d] = rotated(k[h], cos, sin, d)
        keys[h, p0] = row
        ek[h, p0, 0] = quantize_row(row, kbits, False, ints)
        kq[h, p0] = ints
        values[h, p0] = v[h]
        ev[h, p0, 0] = quantize_row(v[h], vbits, False, ints)
        vq[h, p0] = ints
        for g in range(groups):
            for d in range(hd):
                qout[h, g, d] = np.float64(rotated(q[h * groups + g], cos, sin, d))


KERNELS = {
    fn.__name__: njit(**exact_flags)(fn) for fn in (softmax_weights, attend_rows, rotate_store)
}
