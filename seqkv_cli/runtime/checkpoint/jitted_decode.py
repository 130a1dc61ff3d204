"""Native decoders of the stored kinds: rows of blocks (or floats) into their fp32 values,
and the one description of each block kind that the products' kernels read too.

Imported on first use only (numba compiles, or loads from its disk cache). Each decoder
writes the values of `formats.reference_fp32` — gguf-py's fp32 arithmetic, step for step: a
product of a block scale and a quant is exact in fp32 (at most 23 significant bits), so it is
computed in fp64 here; where gguf-py adds two such products, the fp64 sum rounded to fp32 is
the fp32 sum (fp64 carries more than twice fp32's bits plus two, so rounding twice is
rounding once). No fast-math: every operation is its own correctly rounded one.

`specialise` makes one compiled kernel per kind from a template: the kernels stay
module-level functions with names of their own, which numba's disk cache needs
(docs/NUMERICS.md, "Weights at their stored width").
"""

from __future__ import annotations

import math
import types
from dataclasses import dataclass

import numpy as np
from numba import njit

from seqkv_cli.runtime import lanes
from seqkv_cli.runtime.checkpoint.formats import KINDS

flags = {"cache": True, "nogil": True}
inline = {"inline": "always", **flags}

# 2**e for e in [-200, 200]: every power the decoders need (fp16 and bf16 exponents).
_POW_BIAS = 200
_powers = np.ldexp(1.0, np.arange(-_POW_BIAS, _POW_BIAS + 1))


@njit(**inline)
def pow2(e):
    return _powers[e + _POW_BIAS]


half = lanes.half  # an fp16 from its two bytes, exactly


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
        out[k] = half(np.uint8(b & 255), np.uint8(b >> 8))


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


# --- block kinds: one table entry a kind -----------------------------------------------------
#
# A block of BLOCK elements is BLOCK // RUN runs that share a scale a and (AFFINE kinds) an
# offset b: an element's value is a·q for its quant q (exact in fp32: at most 23 significant
# bits), or fp32(a·q + b), one correctly rounded fp32 operation, as gguf-py computes it. A kind
# is two functions: `scales_<kind>(row, blk, down, c1, c0)` writes each run's a·down and b·down
# (`down` a power of two: the products' row scaling, 1 for the values themselves), and
# `lanes_<kind>(row, blk, r, j)` gives the quants of elements j..j+3 of run r as fp64 lanes
# (`runtime.lanes`). Every consumer — these decoders, and the products' integers
# (`runtime.portable.jitted_weights`) — runs the one block loop over them.


@njit(**inline)
def scales_q8_0(row, blk, down, c1, c0):
    c1[0] = half(row[blk * 34], row[blk * 34 + 1]) * down


@njit(**inline)
def lanes_q8_0(row, blk, r, j):
    return lanes.signed_bytes(row, blk * 34 + 2 + j)


# Q4_0 and Q4_1: one run of 32, the low nibbles of the 16 bytes (elements 0..15), then the
# high ones: one scale a block, so one run's set-up a block, not two.
@njit(**inline)
def run_q8_0(row, blk, r):
    return lanes.signed_run(row, blk * 34 + 2)


@njit(**inline)
def scales_q4_0(row, blk, down, c1, c0):
    c1[0] = half(row[blk * 18], row[blk * 18 + 1]) * down


@njit(**inline)
def lanes_q4_0(row, blk, r, j):
    return lanes.bytes_field(row, blk * 18 + 2 + (j & 15), 4 * (j >> 4), 15) - lanes.splat(8.0)


@njit(**inline)
def run_q4_0(row, blk, r):
    return lanes.minus(lanes.split_nibbles(row, blk * 18 + 2), 8)


@njit(**inline)
def scales_q4_1(row, blk, down, c1, c0):
    o = blk * 20
    c1[0] = half(row[o], row[o + 1]) * down
    c0[0] = half(row[o + 2], row[o + 3]) * down


@njit(**inline)
def lanes_q4_1(row, blk, r, j):
    return lanes.bytes_field(row, blk * 20 + 4 + (j & 15), 4 * (j >> 4), 15)


@njit(**inline)
def run_q4_1(row, blk, r):
    return lanes.minus(lanes.split_nibbles(row, blk * 20 + 4), 8)


@njit(**inline)
def scales_q5_0(row, blk, down, c1, c0):  # one run of 32, as Q4_0
    c1[0] = half(row[blk * 22], row[blk * 22 + 1]) * down


@njit(**inline)
def lanes_q5_0(row, blk, r, j):  # a nibble, and bit j of the 32-bit word as its fifth
    o = blk * 22
    return lanes.five_bits(row, o + 6 + (j & 15), 4 * (j >> 4), o + 2, j, 16)


@njit(**inline)
def run_q5_0(row, blk, r):
    o = blk * 22
    return lanes.joined(lanes.split_nibbles(row, o + 6), lanes.word_bits(row, o + 2), 4, 16)


@njit(**inline)
def scales_q5_1(row, blk, down, c1, c0):  # one run of 32, as Q4_1
    o = blk * 24
    c1[0] = half(row[o], row[o + 1]) * down
    c0[0] = half(row[o + 2], row[o + 3]) * down


@njit(**inline)
def lanes_q5_1(row, blk, r, j):
    o = blk * 24
    return lanes.five_bits(row, o + 8 + (j & 15), 4 * (j >> 4), o + 4, j, 0)


@njit(**inline)
def run_q5_1(row, blk, r):
    o = blk * 24
    return lanes.joined(lanes.split_nibbles(row, o + 8), lanes.word_bits(row, o + 4), 4, 16)


@njit(**inline)
def scales_q2_k(row, blk, down, c1, c0):  # 16 runs of 16: a 4-bit scale and min each
    o = blk * 84
    d = half(row[o + 80], row[o + 81]) * down
    dmin = half(row[o + 82], row[o + 83]) * down
    for r in range(16):
        sc = np.int64(row[o + r])
        c1[r] = d * (sc & 15)
        c0[r] = -(dmin * (sc >> 4))


@njit(**inline)
def lanes_q2_k(row, blk, r, j):  # element 16r + j: 2 bits of byte 32·(r // 8) + 16·(r % 2) + j
    at = blk * 84 + 16 + (r // 8) * 32 + (r % 2) * 16 + j
    return lanes.bytes_field(row, at, 2 * ((r % 8) // 2), 3)


@njit(**inline)
def scales_q3_k(row, blk, down, c1, c0):  # 16 runs of 16: 6-bit signed scales
    o = blk * 110
    d = half(row[o + 108], row[o + 109]) * down
    for r in range(16):
        low = (np.int64(row[o + 96 + r % 8]) >> (4 * (r // 8))) & 15
        high = (np.int64(row[o + 104 + r % 4]) >> (2 * (r // 4))) & 3
        c1[r] = d * ((low | (high << 4)) - 32)


@njit(**inline)
def lanes_q3_k(row, blk, r, j):  # 2 low bits, and a high bit whose absence subtracts 4
    o = blk * 110
    t = (r % 2) * 16 + j
    low = lanes.bytes_field(row, o + 32 + (r // 8) * 32 + t, 2 * ((r % 8) // 2), 3)
    high = lanes.bytes_field(row, o + t, r // 2, 1)
    return lanes.fma(high, lanes.splat(4.0), low) - lanes.splat(4.0)


@njit(**inline)
def _scale_min_k4(row, o, j):
    """Q4_K/Q5_K's 6-bit scale and min of sub-block j from the 12 bytes at o."""
    if j < 4:
        return np.int64(row[o + j]) & 63, np.int64(row[o + 4 + j]) & 63
    md = np.int64(row[o + 8 + j - 4])
    sc = (md & 15) | ((np.int64(row[o + j - 4]) >> 2) & 48)
    mn = (md >> 4) | ((np.int64(row[o + j]) >> 2) & 48)
    return sc, mn


@njit(**inline)
def _scales_k4(row, o, down, c1, c0):  # 8 runs of 32
    d = half(row[o], row[o + 1]) * down
    dmin = half(row[o + 2], row[o + 3]) * down
    for r in range(8):
        sc, mn = _scale_min_k4(row, o + 4, r)
        c1[r] = d * sc
        c0[r] = -(dmin * mn)


@njit(**inline)
def scales_q4_k(row, blk, down, c1, c0):
    _scales_k4(row, blk * 144, down, c1, c0)


@njit(**inline)
def lanes_q4_k(row, blk, r, j):  # 32 bytes for runs 2g, 2g + 1: low nibbles, then high ones
    return lanes.bytes_field(row, blk * 144 + 16 + (r // 2) * 32 + j, 4 * (r % 2), 15)


@njit(**inline)
def run_q4_k(row, blk, r):
    return lanes.minus(lanes.field(row, blk * 144 + 16 + (r // 2) * 32, 4 * (r % 2), 15), 8)


@njit(**inline)
def scales_q5_k(row, blk, down, c1, c0):
    _scales_k4(row, blk * 176, down, c1, c0)


@njit(**inline)
def lanes_q5_k(row, blk, r, j):  # as Q4_K, and bit r of byte j of the 32 high-bit bytes
    o = blk * 176
    q = lanes.bytes_field(row, o + 48 + (r // 2) * 32 + j, 4 * (r % 2), 15)
    return lanes.fma(lanes.bytes_field(row, o + 16 + j, r, 1), lanes.splat(16.0), q)


@njit(**inline)
def run_q5_k(row, blk, r):
    o = blk * 176
    q = lanes.field(row, o + 48 + (r // 2) * 32, 4 * (r % 2), 15)
    return lanes.joined(q, lanes.field(row, o + 16, r, 1), 4, 16)


@njit(**inline)
def scales_q6_k(row, blk, down, c1, c0):  # 16 runs of 16: int8 scales
    o = blk * 210
    d = half(row[o + 208], row[o + 209]) * down
    for r in range(16):
        c1[r] = d * signed8(row[o + 192 + r])


@njit(**inline)
def lanes_q6_k(row, blk, r, j):  # element 16r + j of half g = r // 8: 4 low bits, 2 high, - 32
    o = blk * 210
    g, t = r // 8, (r % 8) * 16 + j  # t: the element within its half of 128
    low = lanes.bytes_field(row, o + g * 64 + t % 64, 4 * (t // 64), 15)
    high = lanes.bytes_field(row, o + 128 + g * 32 + t % 32, 2 * (t // 32), 3)
    return lanes.fma(high, lanes.splat(16.0), low) - lanes.splat(32.0)


@njit(**inline)
def run_q6_k(row, blk, r):  # runs r and r + 1 (r even): 32 consecutive t, as lanes_q6_k reads
    o = blk * 210
    g, t = r // 8, (r % 8) * 16
    low = lanes.field(row, o + g * 64 + t % 64, 4 * (t // 64), 15)
    return lanes.joined(low, lanes.field(row, o + 128 + g * 32, 2 * (t // 32), 3), 4, 32)


@dataclass(frozen=True)
class Blocks:
    """A block kind's table entry: elements a block and a run, whether values carry an
    offset (then rounded to fp32 once), its two functions, and a third where runs fill 32
    lanes: `run_<kind>(row, blk, r)`, the quants of run r (of runs r and r + 1 where runs
    are 16 long) as int16 lanes (`lanes.i16x32`), centred: a scaled kind's as its values
    are, an offset kind's quants 0..top less (top + 1) / 2."""

    block: int
    run: int
    affine: bool
    scales: object
    lanes: object
    whole_run: object = None
    top: int = 0


BLOCKS = {
    "q8_0": Blocks(32, 32, False, scales_q8_0, lanes_q8_0, run_q8_0),
    "q4_0": Blocks(32, 32, False, scales_q4_0, lanes_q4_0, run_q4_0),
    "q4_1": Blocks(32, 32, True, scales_q4_1, lanes_q4_1, run_q4_1, 15),
    "q5_0": Blocks(32, 32, False, scales_q5_0, lanes_q5_0, run_q5_0),
    "q5_1": Blocks(32, 32, True, scales_q5_1, lanes_q5_1, run_q5_1, 31),
    "q2_k": Blocks(256, 16, True, scales_q2_k, lanes_q2_k),
    "q3_k": Blocks(256, 16, False, scales_q3_k, lanes_q3_k),
    "q4_k": Blocks(256, 32, True, scales_q4_k, lanes_q4_k, run_q4_k, 15),
    "q5_k": Blocks(256, 32, True, scales_q5_k, lanes_q5_k, run_q5_k, 31),
    "q6_k": Blocks(256, 16, False, scales_q6_k, lanes_q6_k, run_q6_k),
}


def decode_blocks(row, out):  # template (BLOCK, RUN, AFFINE, scales, quants per kind)
    runs = BLOCK // RUN  # noqa: F821
    c1, c0 = np.empty(runs), np.zeros(runs)
    for blk in range(out.shape[0] // BLOCK):  # noqa: F821
        scales(row, blk, 1.0, c1, c0)  # noqa: F821
        for r in range(runs):
            a, b = lanes.splat(c1[r]), lanes.splat(c0[r])
            for j in range(0, RUN, lanes.LANES):  # noqa: F821
                q = quants(row, blk, r, j)  # noqa: F821
                # fp32(a·q + b): one rounding of the exact sum (a·q is exact); a·q alone
                # otherwise, which keeps a negative zero as gguf-py does
                v = lanes.fma(a, q, b) if AFFINE else a * q  # noqa: F821
                lanes.store_f32(out, blk * BLOCK + r * RUN + j, v)  # noqa: F821


def block_bindings(kind: str) -> dict:
    """What a block-loop template reads for ``kind``: BLOCK, RUN, AFFINE, scales, quants."""
    b = BLOCKS[kind]
    return {
        "BLOCK": b.block,
        "RUN": b.run,
        "AFFINE": b.affine,
        "scales": b.scales,
        "quants": b.lanes,
        "whole_run": b.whole_run,
    }


def specialise(template, kind: str, **bindings):
    """``template`` as a new module-level function ``{name}_{kind}`` whose globals include
    ``bindings`` (a kind's constants and functions), not yet compiled."""
    scope = dict(template.__globals__, **bindings)
    fn = types.FunctionType(
        template.__code__, scope, f"{template.__name__}_{kind}", None, template.__closure__
    )
    fn.__qualname__ = f"{template.__qualname__}_{kind}"
    return fn


DECODERS = {
    "f32": decode_f32,
    "f16": decode_f16,
    "bf16": decode_bf16,
    **{
        kind: njit(**inline)(specialise(decode_blocks, kind, **block_bindings(kind)))
        for kind in BLOCKS
    },
}


def _to_fp32(raw, rows, out):  # template: out[i] = the fp32 values of raw[rows[i]]
    for i in range(rows.shape[0]):  # serial: gathers are a few rows, whole walks are once
        decode_row(raw[rows[i]], out[i])  # noqa: F821 (bound per kind by `specialise`)


_compiled: dict[str, object] = {}


def to_fp32(kind: str, raw: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The fp32 values (len(rows), K) of rows ``rows`` of ``raw`` held as ``kind``."""
    fn = _compiled.get(kind)
    if fn is None:
        fn = njit(**flags)(specialise(_to_fp32, kind, decode_row=DECODERS[kind]))
        _compiled[kind] = fn
    out = np.empty((rows.shape[0], KINDS[kind].elements(raw.shape[1])), dtype=np.float32)
    fn(raw, rows.astype(np.int64, copy=False), out)
    return out
