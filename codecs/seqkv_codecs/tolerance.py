"""Bounded-error residual: captured K/V within EPS of recomputed K/V + the stored residual.

Elements whose recomputed value is already within EPS of the captured one cost nothing;
the others store q = round(d / (2·EPS)), so r + q·2·EPS lands within EPS of the captured
value; after rounding to the capture's dtype an element that would break the bound is stored
exactly instead (an escape). The bound max |restored - captured| <= EPS therefore always holds.

Stream (little-endian): magic ``b"SKT1"``, u8 version 1, u8 dtype code (0 bf16, 1 fp16,
2 fp32), u16 reserved 0, f64 EPS, u64 element count n, u64 quantized count, u64 escape
count, then u32 length + rANS stream of the per-element class (0 keep, 1 quantized,
2 escaped; absent when both counts are 0), u32 length + rANS stream(s) of zigzag(q) in 16-bit
planes (u8 plane count first), and the escaped elements' bit patterns (element width each).
"""

from __future__ import annotations

import struct

import numpy as np

from seqkv_codecs.errors import CorruptStreamError
from seqkv_codecs.framing import StreamReader, part
from seqkv_codecs.kvblock import bf16_bits_to_float32, float32_to_bf16_bits

MAGIC = b"SKT1"
_HEAD = struct.Struct("<4sBBHdQQQ")
_FIELDS = "<BHdQQQ"  # _HEAD after its magic and version
_DTYPES = ("bf16", "fp16", "fp32")
_UINT = {"bf16": np.uint16, "fp16": np.uint16, "fp32": np.uint32}


def to_float(bits: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bf16":
        return bf16_bits_to_float32(bits)
    return bits.view(np.float16 if dtype == "fp16" else np.float32).astype(np.float32)


def to_bits(x: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bf16":
        return float32_to_bf16_bits(x.astype(np.float32))
    return x.astype(np.float16 if dtype == "fp16" else np.float32).view(_UINT[dtype])


def _quantized(recomputed: np.ndarray, q: np.ndarray, eps: float, dtype: str) -> np.ndarray:
    # float64 arithmetic, then one rounding to the dtype: identical on encode and decode.
    return to_bits((recomputed.astype(np.float64) + q * (2.0 * eps)).astype(np.float32), dtype)


def encode_tolerance(captured: np.ndarray, recomputed: np.ndarray, dtype: str, eps: float) -> bytes:
    """`captured`/`recomputed`: bit patterns (uint16 for bf16/fp16, uint32 for fp32)."""
    from seqkv_codecs.entropy import encode_symbols

    if not eps > 0:
        raise ValueError(f"tolerance must be > 0, got {eps}")
    x = to_float(captured.ravel(), dtype).astype(np.float64)
    r = to_float(recomputed.ravel(), dtype)
    d = x - r
    cls = np.zeros(x.size, np.uint8)
    far = np.flatnonzero(~(np.abs(d) <= eps))  # NaN/inf differences land here too
    q = np.rint(d[far] / (2.0 * eps))
    ok = np.isfinite(q) & (np.abs(q) < 2**40)
    q = np.where(ok, q, 0).astype(np.int64)
    got = to_float(_quantized(r[far], q, eps, dtype), dtype).astype(np.float64)
    ok &= np.abs(got - x[far]) <= eps
    cls[far[ok]] = 1
    cls[far[~ok]] = 2
    qs, esc = q[ok], captured.ravel()[far[~ok]]
    out = [_HEAD.pack(MAGIC, 1, _DTYPES.index(dtype), 0, eps, x.size, qs.size, esc.size)]
    if far.size:
        out.append(part(encode_symbols(cls, 3)))
        zig = np.where(qs >= 0, 2 * qs, -2 * qs - 1).astype(np.uint64)
        planes = (int(zig.max(initial=0)).bit_length() + 15) // 16
        out.append(bytes([planes]))
        for j in range(planes):
            plane = ((zig >> np.uint64(16 * j)) & np.uint64(0xFFFF)).astype(np.uint16)
            out.append(part(encode_symbols(plane, 65536)))
        out.append(esc.astype(esc.dtype.newbyteorder("<")).tobytes())
    return b"".join(out)


def is_empty(data: bytes) -> bool:
    """Nothing beyond EPS: the stream is only its header, and need not be stored."""
    return len(data) == _HEAD.size and sum(_HEAD.unpack_from(data)[6:]) == 0


def apply_tolerance(data: bytes, recomputed: np.ndarray, dtype: str) -> np.ndarray:
    from seqkv_codecs.entropy import decode_symbols

    reader = StreamReader(data, "tolerance residual")
    reader.opening(MAGIC, (1,))
    code, _, eps, n, nq, ne = reader.unpack(_FIELDS)
    if code >= 3 or _DTYPES[code] != dtype:
        raise CorruptStreamError("not a tolerance residual for this dtype")
    if n != recomputed.size or nq + ne > n or not eps > 0:
        raise CorruptStreamError("tolerance residual does not match the recomputed K/V")
    out = recomputed.ravel().copy()
    if nq + ne == 0:
        reader.finish()
        return out.reshape(recomputed.shape)
    cls = decode_symbols(reader.part(), max_symbols=n)
    (planes,) = reader.unpack("<B")
    zig = np.zeros(nq, np.uint64)
    for j in range(planes):
        plane = decode_symbols(reader.part(), max_symbols=nq)
        if plane.shape != (nq,):
            raise CorruptStreamError("tolerance residual plane has the wrong length")
        zig |= plane.astype(np.uint64) << np.uint64(16 * j)
    width = np.dtype(_UINT[dtype]).itemsize
    escaped = reader.rest()
    if len(escaped) != ne * width or cls.shape != (n,):
        raise CorruptStreamError("tolerance residual has the wrong length")
    qi, ei = np.flatnonzero(cls == 1), np.flatnonzero(cls == 2)
    if qi.size != nq or ei.size != ne:
        raise CorruptStreamError("tolerance residual classes do not match their counts")
    q = np.where(zig % 2 == 0, (zig // 2).astype(np.int64), -((zig + 1) // 2).astype(np.int64))
    out[qi] = _quantized(to_float(out[qi], dtype), q, eps, dtype)
    out[ei] = np.frombuffer(escaped, dtype=np.dtype(_UINT[dtype]).newbyteorder("<"))
    return out.reshape(recomputed.shape)
