"""The numba code of `kernels`' products over stored weights: the definition's integers made
from a checkpoint's own bytes where they are multiplied (imported by `kernels` on first use).

A weight row's integers are ``rint(w · 2**(bits - E))`` for its fp32 values w and its peak
exponent E (`exact.quantize_rows`): the integers the torch reference quantizes from an fp32
copy. Each kind has two row functions, compiled for it (`compile_kind`):

* ``ints_row`` writes a row's integers into a buffer (a prefill's tile, or a step of several
  rows that then reuse them);
* ``dot_row`` sums ``x · integers`` over a row — a one-row step, the common case. Float
  kinds do it in one pass that keeps nothing; block kinds first make the row's integers in a
  row-sized buffer and then sum them in a plain loop (a loop that both makes and sums them
  does not vectorise). It is compiled apart, with reassociation (the one fast-math flag
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
from numba import njit, prange

from seqkv_cli.runtime.checkpoint.jitted_decode import BLOCK_FORMS, ROW_QUANTS, r32, specialise
from seqkv_cli.runtime.portable.jitted import (
    exact_flags,
    peak_exponent,
    pow2,
    quantize_row,
    sum_flags,
)

ROWS_PER_TASK = 16  # weight rows one parallel task takes (each task has its own buffers)
F16_TO_F32 = 2.0**112  # an fp16's bits moved into an fp32's fields, times this: its value


@njit(**sum_flags)
def int_dot(x, w):  # integer-valued terms below 2**53: exact in any order
    acc = 0.0
    for k in range(x.shape[0]):
        acc += x[k] * w[k]
    return acc


# --- row functions, one pair per kind --------------------------------------------------------


def dot_blocks(raw, down, x, q):  # template (SUB, params, unpack bound per kind)
    ints_row(raw, down, q, q)  # noqa: F821 (the row's integers, then one plain dot)
    acc = 0.0
    for k in range(x.shape[0]):
        acc += x[k] * q[k]
    return acc


def ints_blocks(raw, down, out, q):  # template, as dot_blocks
    unpack(raw, out)  # noqa: F821 (the quants, then each run's integers in their place)
    for s in range(out.shape[0] // SUB):  # noqa: F821
        a, b = params(raw, s)  # noqa: F821
        c1, c0 = a * down, b * down
        o = s * SUB  # noqa: F821
        if c1 == np.rint(c1) and c0 == np.rint(c0):
            for j in range(SUB):  # noqa: F821
                out[o + j] = c1 * out[o + j] + c0
        else:
            for j in range(SUB):  # noqa: F821
                out[o + j] = np.rint(r32(a * out[o + j] + b) * down)


def unpack_runs(raw, q):  # template (SUB, quants): a row's quants a run at a time
    for s in range(q.shape[0] // SUB):  # noqa: F821
        quants(raw, s, q[s * SUB : (s + 1) * SUB])  # noqa: F821


def scratch_blocks(k_len):  # a row's quants
    return np.empty(k_len)


def dot_f32(raw, down, x, scratch):
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


def dot_widened(raw, down, x, scratch):  # template (widen, unit bound per kind)
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


def peaks(raw, k_len, out):  # out[n]: exact.quantize_rows' clamped peak exponent of row n
    buf = np.empty(k_len)  # serial: once per weight and process, and the cheapest to compile
    for n in range(raw.shape[0]):
        decode_row(raw[n], buf)  # noqa: F821
        out[n] = peak_exponent(buf)


def tile(raw, start, peak, bits, out):  # out (R, K): the integers of rows start..start+R
    rows, k_len = out.shape
    for task in prange((rows + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
        scratch = new_scratch(k_len)  # noqa: F821
        for r in range(task * ROWS_PER_TASK, min(rows, (task + 1) * ROWS_PER_TASK)):
            ints_row(raw[start + r], pow2(bits - peak[start + r]), out[r], scratch)  # noqa: F821


def step(x, right, l1, raw, peak, bits, out):
    """exact.fixed_product of a one-integer form for few rows: each row of x (M, K; fp32 or
    fp64) quantized as exact.quantize_l1 (l1) or quantize_rows against ``right`` bits, its
    integer sums with every weight row's integers, scaled by 2**(ex + ew) (ew = peak - bits)
    as exact.fixed_matmul: fp64 (M, N), the same bits."""
    m_rows, k_len = x.shape
    xq = np.empty((m_rows, k_len))
    back = np.empty(m_rows)
    for m in range(m_rows):
        back[m] = pow2(quantize_row(x[m], right, l1, xq[m]))
    n_rows = raw.shape[0]
    for task in prange((n_rows + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
        scratch = new_scratch(k_len)  # noqa: F821
        buf = np.empty(k_len if m_rows > 1 else 0)
        for n in range(task * ROWS_PER_TASK, min(n_rows, (task + 1) * ROWS_PER_TASK)):
            down, col = pow2(bits - peak[n]), pow2(peak[n] - bits)
            # 2**(ex + ew) = 2**ex · 2**ew exactly (normal exponents: exact.quantize_rows)
            if m_rows == 1:
                out[0, n] = dot_row(raw[n], down, xq[0], scratch) * (back[0] * col)  # noqa: F821
            else:
                ints_row(raw[n], down, buf, scratch)  # noqa: F821
                for m in range(m_rows):
                    out[m, n] = int_dot(xq[m], buf) * (back[m] * col)


def products(x, raw, peak, bits, out):  # out (M, N): integer sums of x (M, K) with each row
    m_rows, k_len = x.shape
    n_rows = raw.shape[0]
    for task in prange((n_rows + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
        scratch = new_scratch(k_len)  # noqa: F821
        buf = np.empty(k_len)
        for n in range(task * ROWS_PER_TASK, min(n_rows, (task + 1) * ROWS_PER_TASK)):
            ints_row(raw[n], pow2(bits - peak[n]), buf, scratch)  # noqa: F821
            for m in range(m_rows):
                out[m, n] = int_dot(x[m], buf)


_KERNELS = {"peaks": peaks, "tile": tile, "step": step, "products": products}
_SERIAL_TOO = ("step", "products")  # a step of a small model is below the threads' wake-up
_SERIAL_ONLY = ("peaks",)


def _row_functions(kind: str) -> dict:
    """The kind's dot_row (reassociating), ints_row and new_scratch, compiled."""
    if kind in BLOCK_FORMS:
        sub, params, quants = BLOCK_FORMS[kind]
        unpack = ROW_QUANTS.get(kind)
        if unpack is None:
            runs = specialise(unpack_runs, kind, SUB=sub, quants=quants)
            unpack = njit(**{**exact_flags, "inline": "always"})(runs)
        bound = {"SUB": sub, "params": params, "unpack": unpack}
        fns = (dot_blocks, ints_blocks, scratch_blocks)
    elif kind == "f32":
        bound, fns = {}, (dot_f32, ints_f32, scratch_f32)
    else:
        widen = widen_bf16 if kind == "bf16" else widen_f16
        inline = njit(**{**exact_flags, "inline": "always"})(specialise(widen, kind))
        bound = {"widen": inline, "unit": 1.0 if kind == "bf16" else F16_TO_F32}
        fns = (dot_widened, ints_widened, scratch_widened)
    inline = {**exact_flags, "inline": "always"}
    ints = njit(**inline)(specialise(fns[1], kind, **bound))
    dot = specialise(fns[0], kind, **bound, ints_row=ints)  # the block kinds' dot uses it
    return {
        "dot_row": njit(**sum_flags)(dot),
        "ints_row": ints,
        "new_scratch": njit(**inline)(specialise(fns[2], kind, **bound)),
    }


def compile_kind(kind: str) -> dict:
    """{kernel name: (serial, parallel)} for weights held as ``kind``, compiled on first call
    (or loaded from numba's disk cache)."""
    rows = _row_functions(kind)
    out = {}
    for name, template in _KERNELS.items():
        if name in _SERIAL_ONLY:
            serial = njit(**exact_flags)(specialise(template, kind, **rows))
            out[name] = (serial, serial)
            continue
        parallel = njit(parallel=True, **exact_flags)(specialise(template, kind, **rows))
        serial = parallel
        if name in _SERIAL_TOO:
            fn = specialise(template, kind, prange=range, **rows)
            fn.__name__ += "_serial"
            fn.__qualname__ += "_serial"
            serial = njit(**exact_flags)(fn)
        out[name] = (serial, parallel)
    return out
