"""The numba code of `kernels`' products over stored weights: the definition's integers made
from a checkpoint's own bytes where they are multiplied (imported by `kernels` on first use).

A weight row's integers are ``rint(w · 2**(bits - E))`` for its fp32 values w and its peak
exponent E (`exact.quantize_rows`): the integers the torch reference quantizes from an fp32
copy. Each kind has two row functions, compiled for it (`compile_kind`):

* ``dot_row`` sums ``x · integers`` over a row — a one-row step, the common case — without
  keeping the integers;
* ``ints_row`` writes a row's integers into a buffer (a prefill's tile, or a step of several
  rows that then reuse them).

Block kinds run `jitted_decode`'s one block loop (a kind's run scales and quant lanes) in
four fp64 lanes (`runtime.lanes`): with ``down = 2**(bits - E)`` and a run's ``c1 = a·down``,
``c0 = b·down``, an element's integer is ``rint(fp32(c1·q + c0))`` (AFFINE kinds: the value
``fp32(a·q + b)``, scaled by a power of two, which fp32's rounding does not see) or
``rint(c1·q)`` — the reference's integer, computed from the same exact terms. A row's sum
adds ``x · integer`` terms, integers below 2**53 with every partial sum below it too (the
definition's bound), in four accumulators of four lanes: exact in any order, so the bits are
the reference's. Float kinds widen their elements and sum as plain loops.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from seqkv_cli.runtime import lanes
from seqkv_cli.runtime.checkpoint.jitted_decode import BLOCKS, block_bindings, specialise
from seqkv_cli.runtime.portable.jitted import (
    GROUP,
    exact_flags,
    integer_dot,
    pow2,
    quantize_row,
    sum_flags,
)

ROWS_PER_TASK = 16  # weight rows one task of a product kernel takes (its own buffers)
F16_TO_F32 = 2.0**112  # an fp16's bits moved into an fp32's fields, times this: its value


@njit(inline="always", **exact_flags)
def affine_integers(c1, q, c0, whole):  # rint(fp32(c1·q + c0)): c1·q is exact
    # a run whose c1 and c0 are whole numbers has integer values below 2**22: exact in fp32
    return lanes.fma(c1, q, c0) if whole else lanes.rint(lanes.r32(lanes.fma(c1, q, c0)))


@njit(inline="always", **exact_flags)
def scaled_integers(c1, q, c0, whole):  # rint(c1·q): the value a·q is exact
    return c1 * q if whole else lanes.rint(c1 * q)


# --- row functions: templates over a kind's bindings ----------------------------------------


def dot_blocks(raw, down, x, c1, c0):  # template (BLOCK, RUN, scales, quants, integers)
    """Σ x · integers of one row of blocks; c1, c0: scratch of a block's runs."""
    a0 = a1 = a2 = a3 = lanes.zeros()
    for blk in range(x.shape[0] // BLOCK):  # noqa: F821
        scales(raw, blk, down, c1, c0)  # noqa: F821
        for r in range(BLOCK // RUN):  # noqa: F821
            s1, s0 = lanes.splat(c1[r]), lanes.splat(c0[r])
            whole = c1[r] == np.rint(c1[r]) and c0[r] == np.rint(c0[r])
            for j in range(0, RUN, GROUP):  # noqa: F821
                o = blk * BLOCK + r * RUN + j  # noqa: F821
                w0 = integers(s1, quants(raw, blk, r, j), s0, whole)  # noqa: F821
                w1 = integers(s1, quants(raw, blk, r, j + 4), s0, whole)  # noqa: F821
                w2 = integers(s1, quants(raw, blk, r, j + 8), s0, whole)  # noqa: F821
                w3 = integers(s1, quants(raw, blk, r, j + 12), s0, whole)  # noqa: F821
                a0 = lanes.fma(lanes.load(x, o), w0, a0)
                a1 = lanes.fma(lanes.load(x, o + 4), w1, a1)
                a2 = lanes.fma(lanes.load(x, o + 8), w2, a2)
                a3 = lanes.fma(lanes.load(x, o + 12), w3, a3)
    return lanes.total((a0 + a1) + (a2 + a3))


def ints_blocks(raw, down, out, c1, c0):  # template, as dot_blocks
    for blk in range(out.shape[0] // BLOCK):  # noqa: F821
        scales(raw, blk, down, c1, c0)  # noqa: F821
        for r in range(BLOCK // RUN):  # noqa: F821
            s1, s0 = lanes.splat(c1[r]), lanes.splat(c0[r])
            for j in range(0, RUN, lanes.LANES):  # noqa: F821
                o = blk * BLOCK + r * RUN + j  # noqa: F821
                lanes.store(out, o, integers(s1, quants(raw, blk, r, j), s0, False))  # noqa: F821


def scratch_blocks(k_len):  # a block's run scales
    return np.empty(BLOCK // RUN), np.zeros(BLOCK // RUN)  # noqa: F821


def dot_f32(raw, down, x, c1, c0):
    acc = 0.0
    for k in range(x.shape[0]):
        acc += x[k] * np.rint(np.float64(raw[k]) * down)
    return acc


def ints_f32(raw, down, out, c1, c0):
    for k in range(out.shape[0]):
        out[k] = np.rint(np.float64(raw[k]) * down)


def scratch_f32(k_len):
    return np.empty(1, dtype=np.uint32), np.empty(0)


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


def dot_widened(raw, down, x, c1, c0):  # template (widen, unit per kind)
    f = widen(raw, c1)  # noqa: F821 (c1: the row's fp32 bits)
    acc = 0.0
    for k in range(x.shape[0]):
        acc += x[k] * np.rint(np.float64(f[k]) * unit * down)  # noqa: F821
    return acc


def ints_widened(raw, down, out, c1, c0):  # template, as dot_widened
    f = widen(raw, c1)  # noqa: F821
    for k in range(out.shape[0]):
        out[k] = np.rint(np.float64(f[k]) * unit * down)  # noqa: F821


def scratch_widened(k_len):
    return np.empty(k_len, dtype=np.uint32), np.empty(0)


# --- kernels, templates over a kind's row functions ------------------------------------------


def tile(raw, start, peak, bits, out, first, stop):  # out (R, K): rows start..start+R
    rows, k_len = out.shape  # their integers; tasks of ROWS_PER_TASK rows
    for task in range(first, stop):
        c1, c0 = new_scratch(k_len)  # noqa: F821
        for r in range(task * ROWS_PER_TASK, min(rows, (task + 1) * ROWS_PER_TASK)):
            ints_row(raw[start + r], pow2(bits - peak[start + r]), out[r], c1, c0)  # noqa: F821


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
    n_rows = raw.shape[0]
    for task in range(first, stop):
        c1, c0 = new_scratch(k_len)  # noqa: F821
        buf = np.empty(k_len if m_rows > 1 else 0)
        for n in range(task * ROWS_PER_TASK, min(n_rows, (task + 1) * ROWS_PER_TASK)):
            down, col = pow2(bits - peak[n]), pow2(peak[n] - bits)
            # 2**(ex + ew) = 2**ex · 2**ew exactly (normal exponents: exact.quantize_rows)
            if m_rows == 1:
                out[0, n] = dot_row(raw[n], down, xq[0], c1, c0) * (back[0] * col)  # noqa: F821
            else:
                ints_row(raw[n], down, buf, c1, c0)  # noqa: F821
                for m in range(m_rows):
                    out[m, n] = integer_dot(xq[m], buf) * (back[m] * col)


def products(x, raw, peak, bits, out, first, stop):  # out (M, N): integer sums of x (M, K)
    m_rows, k_len = x.shape  # with each weight row
    n_rows = raw.shape[0]
    for task in range(first, stop):
        c1, c0 = new_scratch(k_len)  # noqa: F821
        buf = np.empty(k_len)
        for n in range(task * ROWS_PER_TASK, min(n_rows, (task + 1) * ROWS_PER_TASK)):
            ints_row(raw[n], pow2(bits - peak[n]), buf, c1, c0)  # noqa: F821
            for m in range(m_rows):
                out[m, n] = integer_dot(x[m], buf)


_KERNELS = {"tile": tile, "step": step, "products": products}


def _row_functions(kind: str) -> dict:
    """The kind's dot_row, ints_row and new_scratch, compiled to be inlined."""
    inline = {**exact_flags, "inline": "always"}
    if kind in BLOCKS:
        bound = block_bindings(kind)
        bound["integers"] = affine_integers if BLOCKS[kind].affine else scaled_integers
        bound["GROUP"] = GROUP
        fns = (dot_blocks, ints_blocks, scratch_blocks)
        dot_flags = inline
    elif kind == "f32":
        bound, fns, dot_flags = {}, (dot_f32, ints_f32, scratch_f32), sum_flags
    else:
        widen = widen_bf16 if kind == "bf16" else widen_f16
        bound = {"widen": njit(**inline)(specialise(widen, kind))}
        bound["unit"] = 1.0 if kind == "bf16" else F16_TO_F32
        fns, dot_flags = (dot_widened, ints_widened, scratch_widened), sum_flags
    return {
        # the float kinds' plain loops are compiled apart with reassociation (the terms are
        # integers below 2**53): numba would give an inlined copy its caller's flags
        "dot_row": njit(**dot_flags)(specialise(fns[0], kind, **bound)),
        "ints_row": njit(**inline)(specialise(fns[1], kind, **bound)),
        "new_scratch": njit(**inline)(specialise(fns[2], kind, **bound)),
    }


def compile_kind(kind: str) -> dict:
    """{kernel name: kernel} for weights held as ``kind``, compiled on first call (or loaded
    from numba's disk cache)."""
    rows = _row_functions(kind)
    return {
        name: njit(**exact_flags)(specialise(template, kind, **rows))
        for name, template in _KERNELS.items()
    }
