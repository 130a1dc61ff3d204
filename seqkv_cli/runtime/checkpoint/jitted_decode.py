"""Native decoders of the stored kinds: one row of blocks (or floats) into its fp32 values.

Imported on first use only (numba compiles, or loads from its disk cache). Each decoder
writes the values of `formats.reference_fp32` — gguf-py's fp32 arithmetic, step for step: a
product of a block scale and a quant is exact in fp32 (at most 24 significant bits), so it is
computed in fp64 here; where gguf-py adds two such products, the fp64 sum rounded to fp32 is
the fp32 sum (fp64 carries more than twice fp32's bits plus two, so rounding twice is
rounding once). No fast-math: every operation is its own correctly rounded one.

`specialise` makes one compiled kernel per kind from a template that calls ``decode_row``:
the kernels stay module-level functions with names of their own, which numba's disk cache
needs (docs/NUMERICS.md, "Weights at their stored width").
"""

from __future__ import annotations

import math
import types

import numpy as np
from numba import njit

from seqkv_cli.runtime.checkpoint.formats import KINDS

flags = {"cache": True, "nogil": True}
inline = {"inline": "always", **flags}

# 2**e for e in [-200, 200]: every power the decoders need (fp16 and bf16 exponents).
_POW_BIAS = 200
_powers = np.ldexp(1.0, np.arange(-_POW_BIAS, _POW_BIAS + 1))


@njit(**inline)
def pow2(e):
    return _powers[e + _POW_BIAS]


@njit(**inline)
def half(lo, hi):
    """The fp16 number with bytes lo, hi (little-endian), exactly, as fp64."""
    bits = np.int64(lo) | (np.int64(hi) << 8)
    e = (bits >> 10) & 31
    m = bits & 1023
    if e == 0:
        v = m * pow2(-24)
    elif e == 31:
        v = math.inf if m == 0 else math.nan
    else:
        v = (m + 1024) * pow2(e - 25)
    return -v if bits & 0x8000 else v


@njit(**inline)
def r32(x):
    """x rounded to fp32 (and widened back: exact)."""
    return np.float64(np.float32(x))


@njit(**inline)
def signed8(b):
    return np.int64(b) - 256 if b >= 128 else np.int64(b)


# --- one decoder per kind: decode_<kind>(raw_row, out) -------------------------------------


@njit(**inline)
def decode_f32(raw, out):
    for k in range(out.shape[0]):
        out[k] = raw[k]


@njit(**inline)
def decode_f16(raw, out):
    for k in range(out.shape[0]):
        b = np.int64(raw[k])
        out[k] = half(b & 255, b >> 8)


@njit(**inline)
def decode_bf16(raw, out):
    for k in range(out.shape[0]):
        bits = np.int64(raw[k])
        e = (bits >> 7) & 255
        m = bits & 127
        if e == 0:
            v = m * pow2(-133)
        elif e == 255:
            v = math.inf if m == 0 else math.nan
        else:
            v = (m + 128) * pow2(e - 134)
        out[k] = -v if bits & 0x8000 else v


@njit(**inline)
def decode_q8_0(raw, out):
    for b in range(out.shape[0] // 32):
        o = b * 34
        d = half(raw[o], raw[o + 1])
        for j in range(32):
            out[b * 32 + j] = d * signed8(raw[o + 2 + j])


@njit(**inline)
def decode_q4_0(raw, out):
    for b in range(out.shape[0] // 32):
        o = b * 18
        d = half(raw[o], raw[o + 1])
        for j in range(16):
            q = np.int64(raw[o + 2 + j])
            out[b * 32 + j] = d * ((q & 15) - 8)
            out[b * 32 + 16 + j] = d * ((q >> 4) - 8)


@njit(**inline)
def decode_q4_1(raw, out):
    for b in range(out.shape[0] // 32):
        o = b * 20
        d = half(raw[o], raw[o + 1])
        m = half(raw[o + 2], raw[o + 3])
        for j in range(16):
            q = np.int64(raw[o + 4 + j])
            out[b * 32 + j] = r32(d * (q & 15) + m)
            out[b * 32 + 16 + j] = r32(d * (q >> 4) + m)


@njit(**inline)
def _qh32(raw, o):
    return (
        np.int64(raw[o])
        | (np.int64(raw[o + 1]) << 8)
        | (np.int64(raw[o + 2]) << 16)
        | (np.int64(raw[o + 3]) << 24)
    )


@njit(**inline)
def decode_q5_0(raw, out):
    for b in range(out.shape[0] // 32):
        o = b * 22
        d = half(raw[o], raw[o + 1])
        qh = _qh32(raw, o + 2)
        for j in range(16):
            q = np.int64(raw[o + 6 + j])
            lo = (q & 15) | (((qh >> j) & 1) << 4)
            hi = (q >> 4) | (((qh >> (j + 16)) & 1) << 4)
            out[b * 32 + j] = d * (lo - 16)
            out[b * 32 + 16 + j] = d * (hi - 16)


@njit(**inline)
def decode_q5_1(raw, out):
    for b in range(out.shape[0] // 32):
        o = b * 24
        d = half(raw[o], raw[o + 1])
        m = half(raw[o + 2], raw[o + 3])
        qh = _qh32(raw, o + 4)
        for j in range(16):
            q = np.int64(raw[o + 8 + j])
            lo = (q & 15) | (((qh >> j) & 1) << 4)
            hi = (q >> 4) | (((qh >> (j + 16)) & 1) << 4)
            out[b * 32 + j] = r32(d * lo + m)
            out[b * 32 + 16 + j] = r32(d * hi + m)


@njit(**inline)
def decode_q2_k(raw, out):
    for b in range(out.shape[0] // 256):
        o = b * 84
        d = half(raw[o + 80], raw[o + 81])
        dmin = half(raw[o + 82], raw[o + 83])
        for i in range(256):
            sc = np.int64(raw[o + i // 16])
            g, s, t = i // 128, (i % 128) // 32, i % 32
            q = (np.int64(raw[o + 16 + g * 32 + t]) >> (2 * s)) & 3
            out[b * 256 + i] = r32(d * (sc & 15) * q - dmin * (sc >> 4))


@njit(**inline)
def decode_q3_k(raw, out):
    for b in range(out.shape[0] // 256):
        o = b * 110
        d = half(raw[o + 108], raw[o + 109])
        for i in range(256):
            j = i // 16  # the scale of 16 values: 4 low bits from bytes 0..7, 2 high from 8..11
            low = (np.int64(raw[o + 96 + j % 8]) >> (4 * (j // 8))) & 15
            high = (np.int64(raw[o + 104 + j % 4]) >> (2 * (j // 4))) & 3
            scale = (low | (high << 4)) - 32
            g, s, t = i // 128, (i % 128) // 32, i % 32
            ql = (np.int64(raw[o + 32 + g * 32 + t]) >> (2 * s)) & 3
            hbit = (np.int64(raw[o + t]) >> (i // 32)) & 1
            out[b * 256 + i] = (d * scale) * (ql - ((hbit ^ 1) << 2))


@njit(**inline)
def _scale_min_k4(raw, o, j):
    """Q4_K/Q5_K's 6-bit scale and min of sub-block j from the 12 bytes at o."""
    if j < 4:
        return np.int64(raw[o + j]) & 63, np.int64(raw[o + 4 + j]) & 63
    md = np.int64(raw[o + 8 + j - 4])
    sc = (md & 15) | ((np.int64(raw[o + j - 4]) >> 2) & 48)
    mn = (md >> 4) | ((np.int64(raw[o + j]) >> 2) & 48)
    return sc, mn


@njit(**inline)
def decode_q4_k(raw, out):
    for b in range(out.shape[0] // 256):
        o = b * 144
        d = half(raw[o], raw[o + 1])
        dmin = half(raw[o + 2], raw[o + 3])
        for j in range(8):
            sc, mn = _scale_min_k4(raw, o + 4, j)
            dj, mj = d * sc, dmin * mn
            g, s = j // 2, j % 2
            for t in range(32):
                q = (np.int64(raw[o + 16 + g * 32 + t]) >> (4 * s)) & 15
                out[b * 256 + j * 32 + t] = r32(dj * q - mj)


@njit(**inline)
def decode_q5_k(raw, out):
    for b in range(out.shape[0] // 256):
        o = b * 176
        d = half(raw[o], raw[o + 1])
        dmin = half(raw[o + 2], raw[o + 3])
        for j in range(8):
            sc, mn = _scale_min_k4(raw, o + 4, j)
            dj, mj = d * sc, dmin * mn
            g, s = j // 2, j % 2
            for t in range(32):
                q = (np.int64(raw[o + 48 + g * 32 + t]) >> (4 * s)) & 15
                q |= ((np.int64(raw[o + 16 + t]) >> j) & 1) << 4
                out[b * 256 + j * 32 + t] = r32(dj * q - mj)


@njit(**inline)
def decode_q6_k(raw, out):
    for b in range(out.shape[0] // 256):
        o = b * 210
        d = half(raw[o + 208], raw[o + 209])
        for i in range(256):
            g, r = i // 128, i % 128
            ql = (np.int64(raw[o + g * 64 + r % 64]) >> (4 * (r // 64))) & 15
            qh = (np.int64(raw[o + 128 + g * 32 + r % 32]) >> (2 * (r // 32))) & 3
            scale = signed8(raw[o + 192 + i // 16])
            out[b * 256 + i] = (d * scale) * ((ql | (qh << 4)) - 32)


# --- the same kinds in block form: value(j) = fp32(a · q_j + b) over runs of SUB elements ----
#
# A product kernel (`runtime.portable.jitted_weights`) asks a run's (a, b) once and its small
# integers q_j into a scratch buffer, then makes the definition's integers itself: where
# a · 2**s and b · 2**s are integers, every value in the run is exactly (a·q + b) with no
# fp32 rounding (it is at most the row's peak, below 2**24 units), so its integer is the
# affine c1·q + c0 without a rounding step; elsewhere the value is rounded as above.


@njit(**inline)
def params_q8_0(raw, s):
    o = s * 34
    return half(raw[o], raw[o + 1]), 0.0


@njit(**inline)
def quants_q8_0(raw, s, q):
    o = s * 34 + 2
    for j in range(32):
        q[j] = signed8(raw[o + j])


@njit(**inline)
def params_q4_0(raw, s):
    o = s * 18
    return half(raw[o], raw[o + 1]), 0.0


@njit(**inline)
def quants_q4_0(raw, s, q):
    o = s * 18 + 2
    for j in range(16):
        b = np.int64(raw[o + j])
        q[j] = (b & 15) - 8
        q[16 + j] = (b >> 4) - 8


@njit(**inline)
def params_q4_1(raw, s):
    o = s * 20
    return half(raw[o], raw[o + 1]), half(raw[o + 2], raw[o + 3])


@njit(**inline)
def quants_q4_1(raw, s, q):
    o = s * 20 + 4
    for j in range(16):
        b = np.int64(raw[o + j])
        q[j] = b & 15
        q[16 + j] = b >> 4


@njit(**inline)
def params_q5_0(raw, s):
    o = s * 22
    return half(raw[o], raw[o + 1]), 0.0


@njit(**inline)
def quants_q5_0(raw, s, q):
    o = s * 22
    qh = _qh32(raw, o + 2)
    for j in range(16):
        b = np.int64(raw[o + 6 + j])
        q[j] = ((b & 15) | (((qh >> j) & 1) << 4)) - 16
        q[16 + j] = ((b >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16


@njit(**inline)
def params_q5_1(raw, s):
    o = s * 24
    return half(raw[o], raw[o + 1]), half(raw[o + 2], raw[o + 3])


@njit(**inline)
def quants_q5_1(raw, s, q):
    o = s * 24
    qh = _qh32(raw, o + 4)
    for j in range(16):
        b = np.int64(raw[o + 8 + j])
        q[j] = (b & 15) | (((qh >> j) & 1) << 4)
        q[16 + j] = (b >> 4) | (((qh >> (j + 16)) & 1) << 4)


@njit(**inline)
def params_q2_k(raw, s):  # runs of 16: 16 per block
    o = (s // 16) * 84
    sc = np.int64(raw[o + s % 16])
    return half(raw[o + 80], raw[o + 81]) * (sc & 15), -(half(raw[o + 82], raw[o + 83]) * (sc >> 4))


@njit(**inline)
def quants_q2_k(raw, s, q):
    o = (s // 16) * 84
    for j in range(16):
        i = (s % 16) * 16 + j
        g, sh, t = i // 128, (i % 128) // 32, i % 32
        q[j] = (np.int64(raw[o + 16 + g * 32 + t]) >> (2 * sh)) & 3


@njit(**inline)
def params_q3_k(raw, s):  # runs of 16
    o = (s // 16) * 110
    j = s % 16
    low = (np.int64(raw[o + 96 + j % 8]) >> (4 * (j // 8))) & 15
    high = (np.int64(raw[o + 104 + j % 4]) >> (2 * (j // 4))) & 3
    return half(raw[o + 108], raw[o + 109]) * ((low | (high << 4)) - 32), 0.0


@njit(**inline)
def quants_q3_k(raw, s, q):
    o = (s // 16) * 110
    for j in range(16):
        i = (s % 16) * 16 + j
        g, sh, t = i // 128, (i % 128) // 32, i % 32
        ql = (np.int64(raw[o + 32 + g * 32 + t]) >> (2 * sh)) & 3
        hbit = (np.int64(raw[o + t]) >> (i // 32)) & 1
        q[j] = ql - ((hbit ^ 1) << 2)


@njit(**inline)
def params_q4_k(raw, s):  # runs of 32: 8 per block
    o = (s // 8) * 144
    sc, mn = _scale_min_k4(raw, o + 4, s % 8)
    return half(raw[o], raw[o + 1]) * sc, -(half(raw[o + 2], raw[o + 3]) * mn)


@njit(**inline)
def quants_q4_k(raw, s, q):
    j = s % 8
    o = (s // 8) * 144 + 16 + (j // 2) * 32
    shift = 4 * (j % 2)
    for t in range(32):
        q[t] = (np.int64(raw[o + t]) >> shift) & 15


@njit(**inline)
def params_q5_k(raw, s):
    o = (s // 8) * 176
    sc, mn = _scale_min_k4(raw, o + 4, s % 8)
    return half(raw[o], raw[o + 1]) * sc, -(half(raw[o + 2], raw[o + 3]) * mn)


@njit(**inline)
def quants_q5_k(raw, s, q):
    j = s % 8
    o = (s // 8) * 176
    lo = o + 48 + (j // 2) * 32
    shift = 4 * (j % 2)
    for t in range(32):
        q[t] = ((np.int64(raw[lo + t]) >> shift) & 15) | (
            ((np.int64(raw[o + 16 + t]) >> j) & 1) << 4
        )


@njit(**inline)
def params_q6_k(raw, s):  # runs of 16
    o = (s // 16) * 210
    return half(raw[o + 208], raw[o + 209]) * signed8(raw[o + 192 + s % 16]), 0.0


@njit(**inline)
def quants_q6_k(raw, s, q):
    o = (s // 16) * 210
    for j in range(16):
        i = (s % 16) * 16 + j
        g, r = i // 128, i % 128
        ql = (np.int64(raw[o + g * 64 + r % 64]) >> (4 * (r // 64))) & 15
        qh = (np.int64(raw[o + 128 + g * 32 + r % 32]) >> (2 * (r // 32))) & 3
        q[j] = (ql | (qh << 4)) - 32


# --- a whole row's quants at once, for the commonest kinds -----------------------------------
# A byte becomes its fp64 quant by one load from a 256-entry table: numba does not vectorise
# the per-run int64 -> fp64 conversions of `quants_*`, and unpacking is most of a step's work
# over 4- and 8-bit weights (docs/NUMERICS.md, "Weights at their stored width").

_LOW = np.array([b & 15 for b in range(256)], dtype=np.float64)
_HIGH = np.array([b >> 4 for b in range(256)], dtype=np.float64)
_SIGNED = np.array([b - 256 if b >= 128 else b for b in range(256)], dtype=np.float64)


@njit(**inline)
def row_quants_q8_0(raw, q):
    for s in range(q.shape[0] // 32):
        o = s * 34 + 2
        for j in range(32):
            q[s * 32 + j] = _SIGNED[raw[o + j]]


@njit(**inline)
def row_quants_q4_0(raw, q):
    for s in range(q.shape[0] // 32):
        o = s * 18 + 2
        for j in range(16):
            b = raw[o + j]
            q[s * 32 + j] = _LOW[b] - 8.0
            q[s * 32 + 16 + j] = _HIGH[b] - 8.0


@njit(**inline)
def row_quants_q4_1(raw, q):
    for s in range(q.shape[0] // 32):
        o = s * 20 + 4
        for j in range(16):
            b = raw[o + j]
            q[s * 32 + j] = _LOW[b]
            q[s * 32 + 16 + j] = _HIGH[b]


@njit(**inline)
def row_quants_q4_k(raw, q):  # a block: 4 chunks of 32 bytes, low nibbles a run, high the next
    for blk in range(q.shape[0] // 256):
        o = blk * 144 + 16
        for h in range(4):
            for t in range(32):
                b = raw[o + h * 32 + t]
                q[blk * 256 + h * 64 + t] = _LOW[b]
                q[blk * 256 + h * 64 + 32 + t] = _HIGH[b]


# --- a run's sum of integer activations times its quants, straight from the bytes ------------
# int64 sums of int32 activations times the quants: exact in any order, and a form LLVM
# multiplies four (AVX2) or eight at a time. A one-token step over block weights is mostly
# these (`runtime.portable.jitted_weights.dot_runs`); ``xsum`` is the run's sum of ``xi``.


@njit(**inline)
def run_dot_q8_0(raw, s, xi, o, xsum, q):
    r = s * 34 + 2
    p = np.int64(0)
    for j in range(32):
        p += np.int64(xi[o + j]) * ((np.int64(raw[r + j]) ^ 128) - 128)
    return p


@njit(**inline)
def _nibbles_dot(raw, r, xi, o):  # low nibbles times xi[o:o+16], high ones times the next 16
    p = np.int64(0)
    for j in range(16):
        b = np.int64(raw[r + j])
        p += np.int64(xi[o + j]) * (b & 15) + np.int64(xi[o + 16 + j]) * (b >> 4)
    return p


@njit(**inline)
def run_dot_q4_0(raw, s, xi, o, xsum, q):
    return _nibbles_dot(raw, s * 18 + 2, xi, o) - 8 * xsum


@njit(**inline)
def run_dot_q4_1(raw, s, xi, o, xsum, q):
    return _nibbles_dot(raw, s * 20 + 4, xi, o)


@njit(**inline)
def run_dot_q4_k(raw, s, xi, o, xsum, q):
    j = s % 8
    r = (s // 8) * 144 + 16 + (j // 2) * 32
    shift = 4 * (j % 2)
    p = np.int64(0)
    for t in range(32):
        p += np.int64(xi[o + t]) * ((np.int64(raw[r + t]) >> shift) & 15)
    return p


# kind -> its run sum; the other block kinds unpack a run's quants first.
RUN_DOTS = {
    "q8_0": run_dot_q8_0,
    "q4_0": run_dot_q4_0,
    "q4_1": run_dot_q4_1,
    "q4_k": run_dot_q4_k,
}


# kind -> its whole-row unpacker; the other block kinds go a run at a time (`quants_*`).
ROW_QUANTS = {
    "q8_0": row_quants_q8_0,
    "q4_0": row_quants_q4_0,
    "q4_1": row_quants_q4_1,
    "q4_k": row_quants_q4_k,
}


# kind -> (run length, params, quants); the float kinds have no block form.
BLOCK_FORMS = {
    "q8_0": (32, params_q8_0, quants_q8_0),
    "q4_0": (32, params_q4_0, quants_q4_0),
    "q4_1": (32, params_q4_1, quants_q4_1),
    "q5_0": (32, params_q5_0, quants_q5_0),
    "q5_1": (32, params_q5_1, quants_q5_1),
    "q2_k": (16, params_q2_k, quants_q2_k),
    "q3_k": (16, params_q3_k, quants_q3_k),
    "q4_k": (32, params_q4_k, quants_q4_k),
    "q5_k": (32, params_q5_k, quants_q5_k),
    "q6_k": (16, params_q6_k, quants_q6_k),
}


DECODERS = {
    "f32": decode_f32,
    "f16": decode_f16,
    "bf16": decode_bf16,
    "q8_0": decode_q8_0,
    "q4_0": decode_q4_0,
    "q4_1": decode_q4_1,
    "q5_0": decode_q5_0,
    "q5_1": decode_q5_1,
    "q2_k": decode_q2_k,
    "q3_k": decode_q3_k,
    "q4_k": decode_q4_k,
    "q5_k": decode_q5_k,
    "q6_k": decode_q6_k,
}


def specialise(template, kind: str, **bindings):
    """``template`` as a new module-level function ``{name}_{kind}`` whose global
    ``decode_row`` is that kind's decoder (plus any other ``bindings``), not yet compiled."""
    scope = dict(template.__globals__, decode_row=DECODERS[kind], **bindings)
    fn = types.FunctionType(
        template.__code__, scope, f"{template.__name__}_{kind}", None, template.__closure__
    )
    fn.__qualname__ = f"{template.__qualname__}_{kind}"
    return fn


def _to_fp32(raw, rows, out):  # template: out[i] = the fp32 values of raw[rows[i]]
    for i in range(rows.shape[0]):  # serial: gathers are a few rows, whole walks are once
        decode_row(raw[rows[i]], out[i])  # noqa: F821 (bound per kind by `specialise`)


_compiled: dict[str, object] = {}


def to_fp32(kind: str, raw: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The fp32 values (len(rows), K) of rows ``rows`` of ``raw`` held as ``kind``."""
    fn = _compiled.get(kind)
    if fn is None:
        fn = _compiled[kind] = njit(**flags)(specialise(_to_fp32, kind))
    out = np.empty((rows.shape[0], KINDS[kind].elements(raw.shape[1])), dtype=np.float32)
    fn(raw, rows.astype(np.int64, copy=False), out)
    return out
