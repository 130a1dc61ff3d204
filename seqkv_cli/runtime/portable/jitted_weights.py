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

Where a run's c1 and c0 are whole numbers — in every checkpoint measured, all of them: a
scale's 11 significant bits sit well above the row's unit — no element needs rounding, and a
step sums the run as ``c1·Σ q·x (+ c0·Σ x)``: the quants as int16 lanes, x as two int16 limbs,
their products in 32-bit lanes (`lanes.limb_dot`, `pmaddwd` on x86), four times as many
products an instruction as fp64 lanes (`dot_whole_runs`; docs/NUMERICS.md says why
the sums stay exact). Any run that is not whole, and any row whose x does not fit the limbs,
takes the per-value path above.
"""

from __future__ import annotations

import math

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
# |x| a pair of int16 limbs holds (x = high·2**16 + low, low in [-2**15, 2**15)), with room
LIMB_MAX = 2.0**31 - 2.0**16
# An offset kind's bound on its row's two sums: below 2**53 by more than the bound's own
# rounding (a sum of at most 2**16 runs' terms, each rounded twice)
BOUND_LIMIT = 2.0**53 * (1.0 - 2.0**-30)
F16_TO_F32 = 2.0**112  # an fp16's bits moved into an fp32's fields, times this: its value


@njit(inline="always", **exact_flags)
def affine_integers(c1, q, c0, whole):  # rint(fp32(c1·q + c0)): c1·q is exact
    # a run whose c1 and c0 are whole numbers has integer values below 2**22: exact in fp32
    return lanes.fma(c1, q, c0) if whole else lanes.rint(lanes.r32(lanes.fma(c1, q, c0)))


@njit(inline="always", **exact_flags)
def scaled_integers(c1, q, c0, whole):  # rint(c1·q): the value a·q is exact
    return c1 * q if whole else lanes.rint(c1 * q)


@njit(inline="always", **exact_flags)
def limbs_of(x, low, high, sums, mass):
    """x's int16 limbs, and Σ x and Σ |x| of each run of 32 (`dot_whole_runs`); False where
    some |x| is beyond the limbs, and then no run takes them."""
    sums[:] = 0.0
    mass[:] = 0.0
    for k in range(x.shape[0]):
        v = x[k]
        if abs(v) > LIMB_MAX:
            return False
        i = np.int64(v)
        lo = ((i + 32768) & 65535) - 32768
        low[k] = lo
        high[k] = (i - lo) >> 16
        sums[k // lanes.RUN] += v
        mass[k // lanes.RUN] += abs(v)
    return True


# --- row functions: templates over a kind's bindings ----------------------------------------


def dot_run(raw, blk, r, x, c1, c0, acc):  # template (BLOCK, RUN, quants, integers)
    """acc + Σ x · integers of run r of block blk, per value (four lane accumulators, then
    one add: a run's lanes are independent of the next run's)."""
    s1, s0 = lanes.splat(c1[r]), lanes.splat(c0[r])
    whole = c1[r] == np.rint(c1[r]) and c0[r] == np.rint(c0[r])
    a0 = a1 = a2 = a3 = lanes.zeros()
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
    return acc + ((a0 + a1) + (a2 + a3))


def dot_blocks(
    raw, down, x, c1, c0, low, high, sums, mass, others, fits, shifted, reach
):  # template
    """Σ x · integers of one row of blocks, every run per value; c1, c0: scratch of a block's
    runs (the rest of the arguments are `dot_whole_runs`'). The loop is `dot_run`'s, written
    out: as a call inlined per run it ran 2.5 x slower (Q6_K, measured)."""
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


def dot_whole_runs(
    raw, down, x, c1, c0, low, high, sums, mass, others, fits, shifted, reach
):  # template
    """`dot_blocks` where a run's scale (and offset) are whole numbers: its integers are
    ``c1·q + c0`` exactly, so its sum is ``c1·Σ q·x + c0·Σ x`` with Σ q·x in 16-bit limbs
    (`lanes.limb_dot`). A scaled kind's ``c1·q`` is its integer, so each lane's partial sum
    is one of the definition's and exact. An offset kind's quants are centred (``q - h``,
    with ``c0 + h·c1`` for c0) and its two sums are not the definition's, so the row's bound
    on them, Σ (h·|c1| + |c0 + h·c1|)·Σ|x| over its runs, must be below 2**53 (with room for the
    bound's own rounding); a row above it is summed per value instead. Runs that are not
    whole are listed and taken per value after the loop, which then holds no call and keeps
    its accumulators in registers."""
    acc = lanes.zeros()
    offsets = bound = 0.0
    n_others = 0
    per_block = BLOCK // RUN  # noqa: F821
    # the row's own bounds, made once at load (`run_bounds`): every run whole at this shift,
    # and an offset kind's sums below 2**53 for this x, so no run needs its own checks
    sure = fits and shifted and reach < BOUND_LIMIT
    for blk in range(x.shape[0] // BLOCK):  # noqa: F821
        scales(raw, blk, down, c1, c0)  # noqa: F821
        if RUN == 16:  # noqa: F821 (two runs of 16 fill the 32 lanes; scaled kinds only)
            for r in range(0, per_block, 2):
                a, a2 = c1[r], c1[r + 1]
                if sure or (fits and a == np.rint(a) and a2 == np.rint(a2)):
                    q = whole_run(raw, blk, r)  # noqa: F821
                    o = blk * BLOCK + r * RUN  # noqa: F821
                    acc = lanes.fma(lanes.splat(a), lanes.limb_dot_first(q, low, high, o), acc)
                    acc = lanes.fma(lanes.splat(a2), lanes.limb_dot_second(q, low, high, o), acc)
                else:
                    others[n_others] = blk * per_block + r
                    others[n_others + 1] = blk * per_block + r + 1
                    n_others += 2
            continue
        for r in range(per_block):
            o = blk * BLOCK + r * RUN  # noqa: F821
            a = c1[r]
            if sure or (
                fits and a == np.rint(a) and (not AFFINE or c0[r] == np.rint(c0[r]))  # noqa: F821
            ):
                q = whole_run(raw, blk, r)  # noqa: F821
                acc = lanes.fma(lanes.splat(a), lanes.limb_dot(q, low, high, o), acc)
                if AFFINE:  # noqa: F821
                    b = c0[r] + CENTRE * a  # noqa: F821
                    offsets += b * sums[o // RUN]  # noqa: F821
                    if not sure:
                        bound += (CENTRE * abs(a) + abs(b)) * mass[o // RUN]  # noqa: F821
            else:
                others[n_others] = blk * per_block + r
                n_others += 1
    if AFFINE and not sure and bound > BOUND_LIMIT:  # noqa: F821
        return np.nan  # the caller (`step`) sums this row per value
    rest = lanes.zeros()
    for i in range(n_others):
        blk, r = others[i] // per_block, others[i] % per_block
        scales(raw, blk, down, c1, c0)  # noqa: F821
        rest = run_dot(raw, blk, r, x, c1, c0, rest)  # noqa: F821
    return (lanes.total(acc) + offsets) + lanes.total(rest)


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


def dot_f32(raw, down, x, c1, c0, low, high, sums, mass, others, fits, shifted, reach):
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


def dot_widened(raw, down, x, c1, c0, low, high, sums, mass, others, fits, shifted, reach):
    # template (widen, unit per kind)
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


def step(x, right, l1, raw, peak, runs, bits, out, first, stop):
    """exact.fixed_product of a one-integer form for few rows: each row of x (M, K; fp32 or
    fp64) quantized as exact.quantize_l1 (l1) or quantize_rows against ``right`` bits, its
    integer sums with every weight row's integers, scaled by 2**(ex + ew) (ew = peak - bits)
    as exact.fixed_matmul: fp64 (M, N), the same bits."""
    m_rows, k_len = x.shape
    xq = np.empty((m_rows, k_len))
    back = np.empty(m_rows)
    for m in range(m_rows):
        back[m] = pow2(quantize_row(x[m], right, l1, xq[m]))
    n_runs = -(-k_len // lanes.RUN)
    low, high = np.empty(k_len, np.int16), np.empty(k_len, np.int16)
    sums, mass = np.empty(n_runs), np.empty(n_runs)
    fits = m_rows == 1 and limbs_of(xq[0], low, high, sums, mass)
    total = mass.sum()  # Σ|x|: integers, exact
    others = np.empty(2 * n_runs, np.int64)
    n_rows = raw.shape[0]
    for task in range(first, stop):
        c1, c0 = new_scratch(k_len)  # noqa: F821
        buf = np.empty(k_len if m_rows > 1 else 0)
        for n in range(task * ROWS_PER_TASK, min(n_rows, (task + 1) * ROWS_PER_TASK)):
            down, col = pow2(bits - peak[n]), pow2(peak[n] - bits)
            # 2**(ex + ew) = 2**ex · 2**ew exactly (normal exponents: exact.quantize_rows)
            if m_rows == 1:
                row = raw[n]
                shifted = bits - peak[n] >= runs[n, 0]
                reach = runs[n, 1] * down * total
                dot = dot_row(  # noqa: F821
                    row, down, xq[0], c1, c0, low, high, sums, mass, others, fits, shifted, reach
                )
                if dot != dot:  # a row whose sums dot_row cannot vouch for
                    dot = per_value(  # noqa: F821
                        row, down, xq[0], c1, c0, low, high, sums, mass, others, fits, False, 0.0
                    )
                out[0, n] = dot * (back[0] * col)
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


def run_bounds(raw, k_len, out, first, stop):  # template (BLOCK, RUN, CENTRE, scales)
    """Each row's bounds from its run scales alone (`dot_whole_runs`), out (N, 2): the least
    shift s at which every run's a·2**s and b·2**s are whole numbers, and the largest
    h·|a| + |b + h·a| of its runs (an offset kind's sums are below that times Σ|x|)."""
    c1, c0 = np.empty(BLOCK // RUN), np.zeros(BLOCK // RUN)  # noqa: F821
    for task in range(first, stop):
        for n in range(task * ROWS_PER_TASK, min(raw.shape[0], (task + 1) * ROWS_PER_TASK)):
            least, coef = -1e9, 0.0
            for blk in range(k_len // BLOCK):  # noqa: F821
                scales(raw[n], blk, 1.0, c1, c0)  # noqa: F821
                for r in range(BLOCK // RUN):  # noqa: F821
                    least = max(least, whole_shift(c1[r]), whole_shift(c0[r]))
                    coef = max(coef, CENTRE * abs(c1[r]) + abs(c0[r] + CENTRE * c1[r]))  # noqa: F821
            out[n, 0] = least
            out[n, 1] = coef if np.isfinite(coef) else np.inf


@njit(inline="always", **exact_flags)
def whole_shift(v):
    """The least s with v·2**s a whole number (v = 0: any; not finite: none)."""
    if v == 0.0:
        return -1e9
    if not np.isfinite(v):
        return 1e9
    m, e = math.frexp(v)  # v = m·2**e, m an integer times 2**-53
    i = np.int64(abs(m) * 2.0**53)
    lowest = math.frexp(np.float64(i & -i))[1] - 1  # the exponent of i's lowest set bit
    return np.float64(53 - e - lowest)


_KERNELS = {"tile": tile, "step": step, "products": products}


def _row_functions(kind: str) -> dict:
    """The kind's dot_row, ints_row and new_scratch, compiled to be inlined."""
    inline = {**exact_flags, "inline": "always"}
    if kind in BLOCKS:
        bound = block_bindings(kind)
        bound["integers"] = affine_integers if BLOCKS[kind].affine else scaled_integers
        bound["GROUP"] = GROUP
        bound["run_dot"] = njit(**inline)(specialise(dot_run, kind, **bound))
        bound["BOUND_LIMIT"] = BOUND_LIMIT
        bound["CENTRE"] = _centre(kind)
        dot = dot_whole_runs if BLOCKS[kind].whole_run is not None else dot_blocks
        fns = (dot, ints_blocks, scratch_blocks)
        dot_flags = inline
    elif kind == "f32":
        bound, fns, dot_flags = {}, (dot_f32, ints_f32, scratch_f32), sum_flags
    else:
        widen = widen_bf16 if kind == "bf16" else widen_f16
        bound = {"widen": njit(**inline)(specialise(widen, kind))}
        bound["unit"] = 1.0 if kind == "bf16" else F16_TO_F32
        fns, dot_flags = (dot_widened, ints_widened, scratch_widened), sum_flags
    dot_row = njit(**dot_flags)(specialise(fns[0], kind, **bound))
    per_value = dot_row
    if kind in BLOCKS:  # a call, not inlined: it takes a rare row, and the loop keeps its registers
        per_value = njit(**exact_flags)(specialise(dot_blocks, kind, **bound))
    return {
        "per_value": per_value,
        # the float kinds' plain loops are compiled apart with reassociation (the terms are
        # integers below 2**53): numba would give an inlined copy its caller's flags
        "dot_row": dot_row,
        "ints_row": njit(**inline)(specialise(fns[1], kind, **bound)),
        "new_scratch": njit(**inline)(specialise(fns[2], kind, **bound)),
    }


def _centre(kind: str) -> float:
    """h, the centre an offset kind's quants are taken from in whole runs (0: a scaled kind)."""
    return float((BLOCKS[kind].top + 1) // 2)


def compile_kind(kind: str) -> dict:
    """{kernel name: kernel} for weights held as ``kind``, compiled on first call (or loaded
    from numba's disk cache); ``run_bounds`` for the kinds whose whole runs a step sums in
    limbs."""
    rows = _row_functions(kind)
    kernels = {
        name: njit(**exact_flags)(specialise(template, kind, **rows))
        for name, template in _KERNELS.items()
    }
    if kind in BLOCKS and BLOCKS[kind].whole_run is not None:
        bound = {**block_bindings(kind), "CENTRE": _centre(kind)}
        kernels["run_bounds"] = njit(**exact_flags)(specialise(run_bounds, kind, **bound))
    return kernels
