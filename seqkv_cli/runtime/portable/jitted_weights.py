"""The numba code of `kernels`' products over stored weights: the definition's integers made
from a checkpoint's own bytes where they are multiplied (imported by `kernels` on first use).

A weight row's integers are ``rint(w · 2**(bits - E))`` for its fp32 values w and its peak
exponent E (`exact.quantize_rows`): the integers the torch reference quantizes from an fp32
copy. Each kind has two row functions, compiled for it (`compile_kind`):

* ``ints_row`` writes a row's integers into a buffer (a prefill's tile, or a step of several
  rows that then reuse them);
* ``dot_row`` sums ``x · integers`` over a row — a one-row step, the common case. Float
  kinds do it in one pass that keeps nothing. Block kinds never make the integers: where a
  run's scale and offset are whole numbers c1, c0 of the row's units, the run adds
  ``c1 · Σ x·q + c0 · Σ x`` in int64 (its quants read straight from the bytes: `RUN_DOTS`);
  elsewhere each value is rounded as the reference does and summed in fp64. Both are the
  exact integer sum the reference makes (`integer_form` bounds every int64 partial sum), so
  the bits are the same. It is compiled apart, with reassociation (the one fast-math flag
  allowed: the terms are integers below 2**53, so any order gives the same sum), since numba
  would give an inlined copy its caller's flags.

Block kinds unpack a row's quants first (a table lookup a byte for the commonest kinds,
`jitted_decode.ROW_QUANTS`), then go a run of 16 or 32 values at a time
(`jitted_decode.BLOCK_FORMS`): where the run's scale and offset are whole numbers of the row's
units, the integers are the affine ``c1·q + c0`` with nothing to round; elsewhere each value
is rounded to fp32 and then to its integer, as the reference does. fp16 and bf16 are widened
through their fp32 bit patterns.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from seqkv_cli.runtime.checkpoint.jitted_decode import (
    BLOCK_FORMS,
    ROW_QUANTS,
    RUN_DOTS,
    r32,
    specialise,
)
from seqkv_cli.runtime.portable.jitted import (
    exact_flags,
    pow2,
    quantize_row,
    sum_flags,
)

ROWS_PER_TASK = 16  # weight rows one task of a product kernel takes (its own buffers)
F16_TO_F32 = 2.0**112  # an fp16's bits moved into an fp32's fields, times this: its value
INT32_PEAK = 2.0**31 - 1  # activations the run sums take as int32
QUANT_PEAK = 128  # |q| of every block kind's quants (8 bits at most)
RUN_SUM_BOUND = 2.0**62  # every int64 partial sum of a row stays below this (int64: 2**63)


@njit(**sum_flags)
def int_dot(x, w):  # integer-valued terms below 2**53: exact in any order
    acc = 0.0
    for k in range(x.shape[0]):
        acc += x[k] * w[k]
    return acc


# --- row functions, one pair per kind --------------------------------------------------------


@njit(inline="always", **exact_flags)
def whole(c1, c0):  # a run whose scale and offset are whole numbers of the row's units
    return c1 == np.rint(c1) and c0 == np.rint(c0)


@njit(inline="always", **exact_flags)
def rounded(a, q, b, down):  # one block value's integer, rounded as the reference rounds it
    return np.rint(r32(a * q + b) * down)


@njit(inline="always", **exact_flags)
def integer_form(x, run, xi, xs):
    """A step's integer activations x as int32 (xi) and their sums over each run of ``run``
    (xs), and the bound ``lim`` a run's integer scale and offset must keep: then
    Σ_runs (|c1|·|Σ x·q| + |c0|·|Σ x|) <= lim · (QUANT_PEAK + 1) · Σ|x| <= RUN_SUM_BOUND, so
    no int64 sum can overflow. -1 (every run takes the rounding path) where x does not fit
    int32 or is not finite, or the kind has no runs (``run`` 0)."""
    if run == 0:
        return -1.0
    total = 0.0
    for k in range(x.shape[0]):
        a = abs(x[k])
        if not a <= INT32_PEAK:  # NaN too
            return -1.0
        total += a
    for k in range(x.shape[0]):
        xi[k] = np.int32(x[k])
    for s in range(xs.shape[0]):
        t = np.int64(0)
        for j in range(run):
            t += xi[s * run + j]
        xs[s] = t
    return np.floor(RUN_SUM_BOUND / ((QUANT_PEAK + 1) * max(total, 1.0)))


def dot_runs(raw, down, x, xi, xs, lim, q):  # template (SUB, params, quants, run_dot per kind)
    acc = np.int64(0)  # the runs with whole-number scale and offset, exactly
    rest = 0.0  # the others, rounded value by value as the reference does (exact in fp64)
    for s in range(x.shape[0] // SUB):  # noqa: F821
        a, b = params(raw, s)  # noqa: F821
        c1, c0 = a * down, b * down
        o = s * SUB  # noqa: F821
        if abs(c1) <= lim and abs(c0) <= lim and whole(c1, c0):
            p = run_dot(raw, s, xi, o, xs[s], q)  # noqa: F821
            acc += np.int64(c1) * p + np.int64(c0) * xs[s]
        else:
            quants(raw, s, q)  # noqa: F821
            for j in range(SUB):  # noqa: F821
                rest += x[o + j] * rounded(a, q[j], b, down)
    if rest != rest or abs(rest) == np.inf:  # x or a scale not finite: as the reference's sum
        return rest
    return np.float64(acc + np.int64(rest))  # the row's integer sum, below 2**53: exact


def run_dot_quants(raw, s, xi, o, xsum, q):  # template (SUB, quants): the other block kinds
    quants(raw, s, q)  # noqa: F821
    p = 0.0  # below 2**53: QUANT_PEAK · Σ|x|
    for j in range(SUB):  # noqa: F821
        p += np.float64(xi[o + j]) * q[j]
    return np.int64(p)


def ints_blocks(raw, down, out, q):  # template (SUB, params, unpack bound per kind)
    unpack(raw, out)  # noqa: F821 (the quants, then each run's integers in their place)
    for s in range(out.shape[0] // SUB):  # noqa: F821
        a, b = params(raw, s)  # noqa: F821
        c1, c0 = a * down, b * down
        o = s * SUB  # noqa: F821
        if whole(c1, c0):
            for j in range(SUB):  # noqa: F821
                out[o + j] = c1 * out[o + j] + c0
        else:
            for j in range(SUB):  # noqa: F821
                out[o + j] = rounded(a, out[o + j], b, down)


def unpack_runs(raw, q):  # template (SUB, quants): a row's quants a run at a time
    for s in range(q.shape[0] // SUB):  # noqa: F821
        quants(raw, s, q[s * SUB : (s + 1) * SUB])  # noqa: F821


def scratch_blocks(k_len):  # a row's quants
    return np.empty(k_len)


def dot_f32(raw, down, x, xi, xs, lim, scratch):
    acc = 0.0
    for k in range(x.shape[0]):
        acc += x[k] * np.rint(np.float64(raw[k]) * down)
    return acc


def ints_f32(raw, down, out, scratch):
    for k in range(out.shape[0]):
        out[k] = np.rint(np.float64(raw[k]) * down)


def scratch_f32(k_len):
    return np.empty(1, dtype=np.uint32)


def widen_bf16(raw, bits):  # a bf16 is the top half of an fp32
    for k in range(raw.shape[0]):
        bits[k] = np.uint32(raw[k]) << 16
    return bits.view(np.float32)


def widen_f16(raw, bits):  # fields moved into an fp32's places; value = that fp32 · 2**112
    for k in range(raw.shape[0]):
        h = np.uint32(raw[k])
        f = ((h & 0x7FFF) << 13) | ((h & 0x8000) << 16)
        bits[k] = f | 0x7F800000 if (h & 0x7C00) == 0x7C00 else f  # inf and NaN stay so
    return bits.view(np.float32)


def dot_widened(raw, down, x, xi, xs, lim, scratch):  # template (widen, unit per kind)
    f = widen(raw, scratch)  # noqa: F821
    acc = 0.0
    for k in range(x.shape[0]):
        acc += x[k] * np.rint(np.float64(f[k]) * unit * down)  # noqa: F821
    return acc


def ints_widened(raw, down, out, scratch):  # template, as dot_widened
    f = widen(raw, scratch)  # noqa: F821
    for k in range(out.shape[0]):
        out[k] = np.rint(np.float64(f[k]) * unit * down)  # noqa: F821


def scratch_widened(k_len):
    return np.empty(k_len, dtype=np.uint32)


# --- kernels, templates over a kind's row functions ------------------------------------------


def tile(raw, start, peak, bits, out, first, stop):  # out (R, K): rows start..start+R
    rows, k_len = out.shape  # their integers; tasks of ROWS_PER_TASK rows
    for task in range(first, stop):
        scratch = new_scratch(k_len)  # noqa: F821
        for r in range(task * ROWS_PER_TASK, min(rows, (task + 1) * ROWS_PER_TASK)):
            ints_row(raw[start + r], pow2(bits - peak[start + r]), out[r], scratch)  # noqa: F821


def step(x, right, l1, raw, peak, bits, out, first, stop):
    """exact.fixed_product of a one-integer form for few rows: each row of x (M, K; fp32 or
    fp64) quantized as exact.quantize_l1 (l1) or quantize_rows against ``right`` bits, its
    integer sums with every weight row's integers, scaled by 2**(ex + ew) (ew = peak - bits)
    as exact.fixed_matmul: fp64 (M, N), the same bits."""
    m_rows, k_len = x.shape
    xq = np.empty((m_rows, k_len))
    back = np.empty(m_rows)
    for m in range(m_rows):
        back[m] = pow2(quantize_row(x[m], right, l1, xq[m]))
    one = m_rows == 1
    xi = np.empty(k_len if one else 0, dtype=np.int32)
    xs = np.empty(k_len // RUN if one and RUN else 0, dtype=np.int64)  # noqa: F821
    lim = integer_form(xq[0], RUN, xi, xs) if one else -1.0  # noqa: F821
    n_rows = raw.shape[0]
    for task in range(first, stop):
        scratch = new_scratch(k_len)  # noqa: F821
        buf = np.empty(k_len if m_rows > 1 else 0)
        for n in range(task * ROWS_PER_TASK, min(n_rows, (task + 1) * ROWS_PER_TASK)):
            down, col = pow2(bits - peak[n]), pow2(peak[n] - bits)
            # 2**(ex + ew) = 2**ex · 2**ew exactly (normal exponents: exact.quantize_rows)
            if one:
                dot = dot_row(raw[n], down, xq[0], xi, xs, lim, scratch)  # noqa: F821
                out[0, n] = dot * (back[0] * col)
            else:
                ints_row(raw[n], down, buf, scratch)  # noqa: F821
                for m in range(m_rows):
                    out[m, n] = int_dot(xq[m], buf) * (back[m] * col)


def products(x, raw, peak, bits, out, first, stop):  # out (M, N): integer sums of x (M, K)
    m_rows, k_len = x.shape  # with each weight row
    n_rows = raw.shape[0]
    for task in range(first, stop):
        scratch = new_scratch(k_len)  # noqa: F821
        buf = np.empty(k_len)
        for n in range(task * ROWS_PER_TASK, min(n_rows, (task + 1) * ROWS_PER_TASK)):
            ints_row(raw[n], pow2(bits - peak[n]), buf, scratch)  # noqa: F821
            for m in range(m_rows):
                out[m, n] = int_dot(x[m], buf)


_KERNELS = {"tile": tile, "step": step, "products": products}


def _row_functions(kind: str) -> dict:
    """The kind's dot_row (reassociating), ints_row and new_scratch, compiled."""
    inline = {**exact_flags, "inline": "always"}
    if kind in BLOCK_FORMS:
        sub, params, quants = BLOCK_FORMS[kind]
        unpack = ROW_QUANTS.get(kind)
        if unpack is None:
            runs = specialise(unpack_runs, kind, SUB=sub, quants=quants)
            unpack = njit(**inline)(runs)
        run_dot = RUN_DOTS.get(kind)
        if run_dot is None:
            run_dot = njit(**inline)(specialise(run_dot_quants, kind, SUB=sub, quants=quants))
        bound = {"SUB": sub, "params": params, "unpack": unpack, "quants": quants}
        bound |= {"run_dot": run_dot, "RUN": sub}
        fns = (dot_runs, ints_blocks, scratch_blocks)
    elif kind == "f32":
        bound, fns = {"RUN": 0}, (dot_f32, ints_f32, scratch_f32)
    else:
        widen = widen_bf16 if kind == "bf16" else widen_f16
        bound = {"widen": njit(**inline)(specialise(widen, kind)), "RUN": 0}
        bound["unit"] = 1.0 if kind == "bf16" else F16_TO_F32
        fns = (dot_widened, ints_widened, scratch_widened)
    return {
        "dot_row": njit(**sum_flags)(specialise(fns[0], kind, **bound)),
        "ints_row": njit(**inline)(specialise(fns[1], kind, **bound)),
        "new_scratch": njit(**inline)(specialise(fns[2], kind, **bound)),
        "RUN": bound["RUN"],
    }


def compile_kind(kind: str) -> dict:
    """{kernel name: kernel} for weights held as ``kind``, compiled on first call (or loaded
    from numba's disk cache)."""
    rows = _row_functions(kind)
    return {
        name: njit(**exact_flags)(specialise(template, kind, **rows))
        for name, template in _KERNELS.items()
    }
