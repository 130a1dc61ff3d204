"""Surprisal-adaptive residual quantizer (arXiv 2604.15356, Layer 2), model-free.

A prediction residual R (positions, components) is stored with a bit width b_i per position
chosen by the caller from the model's surprisal s_i (:func:`bits_from_surprisal`): where the
model was confident the prediction is good and few bits suffice; b_i = 0 stores nothing.
Each vector of ``vector_len`` components (one head's key or value at one layer) of a position
with b_i >= 1 gets an fp16 scale (its absmax, rounded up) and uniform symmetric codes with
step scale / 2^(b-1): levels -2^(b-1)..2^(b-1) times the step, so zero and ±scale are exact.
Hence ``|R - R̂| <= scale / 2^b <= scale / (2^b - 1)`` per element, and never more than |R|
(zero is a level), which a midrise grid cannot promise: its 1-bit codes are ±scale. The
2^b + 1 levels are entropy-coded, so b sets the resolution, not a fixed code width.

Stream (little-endian): header ``b"SKAQ"``, version u8, max_bits u8, reserved u16,
n_positions u32, components per position u32, vector_len u32; then ``max_bits + 3`` sections,
each a u32 length and an entropy stream (:func:`seqkv_codecs.entropy.encode_symbols`), empty
when it has no symbols: bits per position, scale high bytes, scale low bytes, then the codes of
width 1, 2, ..., max_bits in position order; then a CRC32 of everything before it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from seqkv_codecs.entropy import decode_symbols, encode_symbols
from seqkv_codecs.errors import CodecError, CorruptStreamError
from seqkv_codecs.framing import StreamReader, part, with_crc32

MAGIC = b"SKAQ"
VERSION = 1
MAX_BITS = 8
_HEAD = struct.Struct("<4sBBHIII")
_FIELDS = "<BHIII"  # _HEAD after its magic and version
_FP16_MAX = float(np.finfo(np.float16).max)


@dataclass(frozen=True, eq=False)
class Dequantized:
    """A decoded stream: R̂ (positions, components) fp32, bits (positions,), scales (pos, vec)."""

    values: np.ndarray
    bits: np.ndarray
    scales: np.ndarray

    def error_bound(self) -> np.ndarray:
        """Per-vector bound on |R - R̂| for positions with b >= 1 (inf where b = 0)."""
        b = self.bits.astype(np.float64)[:, None]
        return np.where(b > 0, self.scales / 2.0**b, np.inf)


def bits_from_surprisal(
    surprisal: np.ndarray, *, base: float, slope: float, max_bits: int
) -> np.ndarray:
    """b_i = clamp(round(base + slope * s_i), 0, max_bits), uint8: the allocation rule."""
    if not 0 <= max_bits <= MAX_BITS:
        raise CodecError(f"max_bits must be in 0..{MAX_BITS}, got {max_bits}")
    s = np.asarray(surprisal, dtype=np.float64)
    return np.clip(np.rint(base + slope * s), 0, max_bits).astype(np.uint8)


def _fp16_ceil(x: np.ndarray) -> np.ndarray:
    """Smallest fp16 >= x (so |R| <= scale holds with the stored scale)."""
    h = x.astype(np.float16)
    low = h.astype(np.float32) < x
    h[low] = np.nextafter(h[low], np.float16(np.inf))
    return h


def quantize(residual: np.ndarray, bits: np.ndarray, vector_len: int, max_bits: int) -> bytes:
    """Encode ``residual`` (n, m) float with per-position widths ``bits`` (n,) <= ``max_bits``."""
    r = np.asarray(residual, dtype=np.float32)
    b = np.asarray(bits)
    if r.ndim != 2 or b.shape != (r.shape[0],) or vector_len < 1 or r.shape[1] % vector_len:
        raise CodecError(
            f"residual must be (n, m) with m a multiple of vector_len={vector_len} and bits (n,);"
            f" got {r.shape} and {b.shape}"
        )
    if not 0 <= max_bits <= MAX_BITS or (b.size and not 0 <= int(b.min()) <= b.max() <= max_bits):
        raise CodecError(f"bits must lie in 0..max_bits and max_bits in 0..{MAX_BITS}")
    if not np.isfinite(r).all():
        raise CodecError("the residual holds NaN or infinity; it cannot be quantized")
    n, m = r.shape
    vec = r.reshape(n, m // vector_len, vector_len)
    kept, widths = vec[b > 0], b[b > 0]
    scales = _fp16_ceil(np.abs(kept).max(axis=-1, initial=0.0))
    if scales.size and float(scales.astype(np.float32).max()) > _FP16_MAX:
        raise CodecError("a residual exceeds the fp16 scale range (65504); not quantizable")
    sections = [_symbols(b.astype(np.uint8), max_bits + 1)]
    raw = scales.view(np.uint16).ravel()
    sections += [_symbols(raw >> 8, 256), _symbols(raw & 0xFF, 256)]
    s64 = scales.astype(np.float64)[..., None]
    inv = np.divide(1.0, s64, out=np.zeros_like(s64), where=s64 > 0)
    for width in range(1, max_bits + 1):
        rows, half = widths == width, 1 << (width - 1)
        codes = np.clip(np.rint(kept[rows] * inv[rows] * half), -half, half) + half
        sections.append(_symbols(codes.astype(np.int64).ravel(), 2 * half + 1))
    out = _HEAD.pack(MAGIC, VERSION, max_bits, 0, n, m, vector_len)
    return with_crc32(out + b"".join(part(s) for s in sections))


def _symbols(values: np.ndarray, alphabet: int) -> bytes:
    return encode_symbols(values, alphabet) if values.size else b""


def dequantize(data: bytes, *, max_positions: int | None = None) -> Dequantized:
    """Decode a :func:`quantize` stream; any damage raises ``CorruptStreamError``."""
    reader = StreamReader(data, "residual", trailing_crc32=True)
    reader.opening(MAGIC, (VERSION,))
    max_bits, reserved, n, m, vlen = reader.unpack(_FIELDS)
    if max_bits > MAX_BITS or reserved or vlen == 0 or m % vlen:
        raise CorruptStreamError("residual stream header is invalid")
    if max_positions is not None and n > max_positions:
        raise CorruptStreamError(f"residual stream holds {n} positions, expected {max_positions}")
    sections = reader.parts(max_bits + 3)
    reader.finish()
    bits = _decode(sections[0], n, "bits").astype(np.uint8)
    if bits.size and bits.max() > max_bits:
        raise CorruptStreamError("residual stream has a bit width above its max_bits")
    kept, nvec = bits > 0, m // vlen
    count = int(kept.sum()) * nvec
    raw = (_decode(sections[1], count, "scales").astype(np.uint16) << 8) | _decode(
        sections[2], count, "scales"
    )
    scales = np.zeros((n, nvec), dtype=np.float32)
    scales[kept] = raw.view(np.float16).astype(np.float32).reshape(-1, nvec)
    values = np.zeros((n, nvec, vlen), dtype=np.float32)
    for width in range(1, max_bits + 1):
        rows = np.flatnonzero(bits == width)
        codes = _decode(sections[2 + width], rows.size * m, f"{width}-bit codes")
        half = 1 << (width - 1)
        if codes.size and codes.max() > 2 * half:
            raise CorruptStreamError(f"residual stream: a {width}-bit code is out of range")
        q = codes.reshape(rows.size, nvec, vlen).astype(np.float64) - half
        values[rows] = (q / half * scales[rows][..., None]).astype(np.float32)
    return Dequantized(values.reshape(n, m), bits, scales)


def _decode(section: bytes, count: int, what: str) -> np.ndarray:
    if count == 0:
        if section:
            raise CorruptStreamError(f"residual stream: unexpected {what} data")
        return np.zeros(0, dtype=np.uint16)
    try:
        out = decode_symbols(section, max_symbols=count)
    except (CodecError, ValueError) as exc:
        raise CorruptStreamError(f"residual stream: {what} do not decode: {exc}") from None
    if out.size != count:
        raise CorruptStreamError(f"residual stream: {out.size} {what}, expected {count}")
    return out.astype(np.uint16)
