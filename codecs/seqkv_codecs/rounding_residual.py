"""Lossless residual modelled on rounding: captured K/V against the recompute *before* it was
rounded to the stored dtype.

A cache written by another numeric path (the user's own transformers run, llama.cpp) differs
from the canonical recompute by that path's rounding noise. Whether an element of the stored
dtype differs depends on two things the decoder can see, because it holds the unrounded
recompute: how far the recomputed value lies from the nearest rounding boundary of the dtype,
and how large the noise is against that distance. The noise scales with the row (one head's
vector at one position), not with the element, so small elements of a row of large ones flip
often and large ones rarely. Each element's context is therefore

    c = clamp(-exponent(distance to the nearest rounding boundary / max |value| of its row))

(for fp32 caches, which are not rounded, the distance is the element's own spacing). Within
a context the differences are close to independent, so the stream stores, per context, how
many elements differ and where (Rice-coded gaps), then each difference's size.

Version 2 (written since seqkv 0.3) holds all of that in one bit string behind a header of
10 to 13 bytes. Version 1 spent ~110 bytes per stream on fixed fields (u64 counts, u32
lengths, a rANS table for a few dozen symbols): once the recompute was as close to the real
numbers as fp32 (numeric path `portable-fx53-v2`) that was three quarters of a 400-token
session's residual, 60 streams of it. Measured on an fp32-compute transformers cache stored
as bf16, 400 prose tokens of the embedded model: 942 bits/position as `SKR1`, 176 as version
1, 84 as version 2 (docs/BENCHMARKS.md). Version 1 streams still decode.

Every quantity above is computed with exactly rounded float64 operations and `frexp` (no
transcendental functions, whose last bits differ between libraries), so the encoder and any
decoder derive the same contexts from the same recompute. Stream layout: docs/FORMAT.md,
"Exact, modelled on rounding (`SKR2`)".
"""

from __future__ import annotations

import struct

import numpy as np

from seqkv_codecs.bits import BitReader, BitWriter, bit_length
from seqkv_codecs.errors import CorruptStreamError
from seqkv_codecs.framing import StreamReader
from seqkv_codecs.varint import decode_varint, encode_varint

MAGIC = b"SKR2"
VERSION = 2  # written; version 1 is read
_HEAD = struct.Struct("<4sBB")  # magic, version, dtype code; version 2: sizes, varints n, z
SIZES_UNARY, SIZES_RANS = 0, 1  # version 2: how the bit lengths of the differences are coded
_RANS_FROM = 64  # differences from which a rANS table of their bit lengths may pay for itself
_FIELDS_V1 = "<HQQ"  # version 1, after magic, version and dtype code: reserved, n, nonzero count
DTYPES = ("bf16", "fp16", "fp32")
_UINT = {"bf16": np.uint16, "fp16": np.uint16, "fp32": np.uint32}
CONTEXTS = 64  # c in 0..63: the row-relative distance from 2**-63 up to 1 and above
BUCKETS = 36  # bit lengths 0..35 of zigzag(offset difference), |difference| < 2**33
MAX_LENGTH = 40  # version 2: longest bit length of a coded count or difference (both < 2**40)


def dtype_of(data: bytes) -> str | None:
    """The stored dtype an `SKR2` stream was written for (None if it is not one)."""
    if len(data) < _HEAD.size + 1 or data[:4] != MAGIC or data[5] >= len(DTYPES):
        return None
    return DTYPES[data[5]]


def rounded_bits(recomputed: np.ndarray, dtype: str) -> np.ndarray:
    """The recompute rounded to `dtype` (round to nearest even), as bit patterns."""
    from seqkv_codecs.tolerance import to_bits

    with np.errstate(over="ignore"):  # past the dtype's range is inf, as torch rounds it
        return to_bits(np.ascontiguousarray(recomputed, dtype=np.float32), dtype)


def contexts(recomputed: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(bits of the rounded recompute, direction of the nearer neighbour (+1/-1, in bit-pattern
    steps), context 0..63) for every element, flattened."""
    from seqkv_codecs.tolerance import to_float

    r = np.ascontiguousarray(recomputed, dtype=np.float32)
    base = rounded_bits(r, dtype)
    x = r.astype(np.float64)
    with np.errstate(all="ignore"):  # inf/NaN recomputes land in context 0, on both sides
        if dtype == "fp32":
            toward = np.ones(x.shape, np.int64)
            dist = np.abs(np.spacing(r).astype(np.float64))
        else:
            rv = to_float(base, dtype).astype(np.float64)
            # bit patterns are sign + magnitude: one step up is one step away from zero
            toward = np.where(np.abs(x) >= np.abs(rv), 1, -1).astype(np.int64)
            top = np.int64((1 << (8 * base.dtype.itemsize)) - 1)
            neighbour = np.clip(base.astype(np.int64) + toward, 0, top).astype(base.dtype)
            boundary = (rv + to_float(neighbour, dtype).astype(np.float64)) / 2
            dist = np.abs(x - boundary)
        scale = np.abs(x).max(axis=-1, keepdims=True) if x.ndim and x.shape[-1] else x
        _, exponent = np.frexp(dist / scale)
    ctx = np.clip(-exponent.astype(np.int64), 0, CONTEXTS - 1)
    return base.ravel(), toward.ravel(), ctx.ravel()


def encode_rounding_residual(captured: np.ndarray, recomputed: np.ndarray, dtype: str) -> bytes:
    """`captured`: bit patterns of `dtype` (uint16/uint32); `recomputed`: the float32 recompute
    of the same shape, before rounding to `dtype`."""
    from seqkv_codecs.entropy import encode_symbols

    if dtype not in DTYPES:
        raise ValueError(f"rounding residuals are for {', '.join(DTYPES)}, not {dtype!r}")
    if captured.shape != recomputed.shape or captured.dtype != _UINT[dtype]:
        raise ValueError("captured bits and the recompute must have the same shape")
    base, toward, ctx = contexts(recomputed, dtype)
    diff = captured.astype(np.int64).ravel() - base.astype(np.int64)
    nonzero = diff != 0
    z = int(nonzero.sum())
    if not z:
        return (
            _HEAD.pack(MAGIC, VERSION, DTYPES.index(dtype))
            + bytes([SIZES_UNARY])
            + (encode_varint(diff.size) + encode_varint(0))
        )
    present = [c for c in range(CONTEXTS) if (ctx == c).any()]
    hits_of = {c: nonzero[ctx == c] for c in present}
    u = _signed_to_code(diff[nonzero] * toward[nonzero])
    lengths = bit_length(u)

    def stream(sizes: int) -> bytes:
        bits = BitWriter("lsb")
        bits.gamma(np.array([int(hits_of[c].sum()) for c in present], np.int64))
        for c in present:
            hits = hits_of[c]
            _write_positions(bits, hits, hits.size, int(hits.sum()))
        table = b""
        if sizes == SIZES_UNARY:
            bits.unary(lengths)
        else:
            table = encode_symbols(lengths.astype(np.uint8), BUCKETS)
            table = encode_varint(len(table)) + table
        bits.varying(u, np.maximum(lengths - 1, 0))
        head = _HEAD.pack(MAGIC, VERSION, DTYPES.index(dtype)) + bytes([sizes])
        return head + encode_varint(diff.size) + encode_varint(z) + table + bits.getvalue()

    # a few dozen differences, mostly one step: unary lengths; many broad ones (an fp32
    # cache): a rANS table of the lengths
    candidates = [stream(SIZES_UNARY)] + ([stream(SIZES_RANS)] if z >= _RANS_FROM else [])
    return min(candidates, key=len)


def apply_rounding_residual(data: bytes, recomputed: np.ndarray, dtype: str) -> np.ndarray:
    """Captured bit patterns (shape of `recomputed`) = rounded recompute + the residual."""
    reader = StreamReader(data, "rounding residual")
    version = reader.opening(MAGIC, (1, VERSION))
    (code,) = reader.unpack("<B")
    if code >= len(DTYPES):
        raise CorruptStreamError(f"rounding residual for an unknown dtype (code {code})")
    if DTYPES[code] != dtype:
        raise CorruptStreamError(f"rounding residual for {DTYPES[code]}, the session is {dtype}")
    if version == 1:
        reserved, n, z = reader.unpack(_FIELDS_V1)
        if reserved:
            raise CorruptStreamError("not a rounding residual stream of version 1")
    else:
        (sizes,) = reader.unpack("<B")
        if sizes not in (SIZES_UNARY, SIZES_RANS):
            raise CorruptStreamError("rounding residual of version 2 with an unknown size coding")
        n, z = reader.varint(), reader.varint()
    if n != recomputed.size or z > n:
        raise CorruptStreamError("rounding residual does not match the recomputed K/V")
    base, toward, ctx = contexts(recomputed, dtype)
    flat = base.astype(np.int64)
    if z:
        if version == 1:
            nonzero, steps = _differences_v1(reader, ctx, z, _offset(dtype))
        else:
            nonzero, steps = _differences(reader, sizes, ctx, z)
        flat[nonzero] += steps * toward[nonzero]
    else:
        reader.finish()
    if flat.min(initial=0) < 0 or flat.max(initial=0) > int(np.iinfo(_UINT[dtype]).max):
        raise CorruptStreamError("rounding residual moves a value out of range")
    return flat.astype(_UINT[dtype]).reshape(recomputed.shape)


def _differences(
    reader: StreamReader, sizes: int, ctx: np.ndarray, z: int
) -> tuple[np.ndarray, np.ndarray]:
    """Version 2: which elements differ (a mask) and by how many steps toward the nearer
    neighbour, from the stream after its header."""
    from seqkv_codecs.entropy import decode_symbols

    table = reader.take(reader.varint()) if sizes == SIZES_RANS else b""
    bits = BitReader(reader.rest(), "lsb", "rounding residual bits")
    where_of = [w for w in (np.flatnonzero(ctx == c) for c in range(CONTEXTS)) if w.size]
    counts = bits.gamma(len(where_of), MAX_LENGTH).astype(np.int64)
    if int(counts.sum()) != z or any(k > w.size for k, w in zip(counts, where_of, strict=True)):
        raise CorruptStreamError("rounding residual counts do not add up to its header")
    nonzero = np.zeros(ctx.size, bool)
    for k, where in zip(counts, where_of, strict=True):
        nonzero[where] = _read_positions(bits, where.size, int(k))
    if sizes == SIZES_UNARY:
        lengths = bits.unary(z)
    else:
        lengths = decode_symbols(table, max_symbols=z).astype(np.int64)
        if lengths.shape != (z,):
            raise CorruptStreamError("rounding residual has the wrong number of differences")
    if lengths.max(initial=0) > MAX_LENGTH:
        raise CorruptStreamError("rounding residual holds a difference too large for it")
    low = bits.varying(np.maximum(lengths - 1, 0)).astype(np.int64)
    steps = _code_to_signed(
        np.where(lengths >= 1, np.int64(1) << np.maximum(lengths - 1, 0), 0) | low
    )
    bits.finish()
    return nonzero, steps


def _differences_v1(
    reader: StreamReader, ctx: np.ndarray, z: int, offset: int
) -> tuple[np.ndarray, np.ndarray]:
    """Version 1 (seqkv 0.2): varint counts and rANS buckets of the sizes in two parts."""
    from seqkv_codecs.entropy import decode_symbols

    counts, buckets = reader.parts(2)
    bits = BitReader(reader.rest(), "lsb", "rounding residual bits")
    nonzero = np.zeros(ctx.size, bool)
    at = 0
    for c in range(CONTEXTS):
        where = np.flatnonzero(ctx == c)
        if not where.size:
            continue
        k, at = decode_varint(counts, at)
        if k > where.size:
            raise CorruptStreamError("rounding residual counts more differences than elements")
        nonzero[where] = _read_positions(bits, where.size, k)
    if at != len(counts) or int(nonzero.sum()) != z:
        raise CorruptStreamError("rounding residual counts do not add up to its header")
    lengths = decode_symbols(buckets, max_symbols=z).astype(np.int64)
    if lengths.shape != (z,) or lengths.max(initial=0) >= BUCKETS:
        raise CorruptStreamError("rounding residual has the wrong number of differences")
    u = np.where(lengths >= 1, np.int64(1) << np.maximum(lengths - 1, 0), 0)
    for b in range(2, BUCKETS):
        sel = lengths == b
        if sel.any():
            u[sel] |= bits.fixed(int(sel.sum()), b - 1).astype(np.int64)
    bits.finish()
    return nonzero, _unzigzag(u) + offset


def _signed_to_code(steps: np.ndarray) -> np.ndarray:
    """Version 2: a difference s (never 0) as a code u >= 0, one step toward the nearer
    neighbour first: s = 1, -1, 2, -2, ... -> u = 0, 1, 2, 3, ..."""
    return np.where(steps > 0, 2 * steps - 2, -2 * steps - 1)


def _code_to_signed(u: np.ndarray) -> np.ndarray:
    return np.where(u % 2 == 0, u // 2 + 1, -(u + 1) // 2)


def _offset(dtype: str) -> int:
    # version 1: a rounded element that differs is most often one step toward its nearer neighbour
    return 0 if dtype == "fp32" else 1


def _unzigzag(u: np.ndarray) -> np.ndarray:
    return np.where(u % 2 == 0, u // 2, -(u + 1) // 2)


def _rice_parameter(n: int, m: int) -> int:
    """floor(log2(ln 2 * n / m)): near the best Rice code for gaps of mean n / m."""
    return max(0, (n * 710 // (1024 * m)).bit_length() - 1)


def _write_positions(bits: BitWriter, hits: np.ndarray, n: int, k: int) -> None:
    """Where the k hits of n lie: the gaps between the rarer class (hits or misses)."""
    if k == 0 or k == n:
        return
    rare = np.flatnonzero(hits if 2 * k <= n else ~hits)
    gaps = np.diff(rare, prepend=-1) - 1
    b = _rice_parameter(n, rare.size)
    bits.unary(gaps >> b)
    bits.fixed(gaps & ((1 << b) - 1), b)


def _read_positions(bits: BitReader, n: int, k: int) -> np.ndarray:
    if k == 0 or k == n:
        return np.full(n, k == n)
    m = min(k, n - k)
    b = _rice_parameter(n, m)
    gaps = (bits.unary(m) << b) | bits.fixed(m, b).astype(np.int64)
    rare = np.cumsum(gaps + 1) - 1
    if rare[-1] >= n:
        raise CorruptStreamError("rounding residual points past its context")
    out = np.zeros(n, bool)
    out[rare] = True
    return out if 2 * k <= n else ~out
