"""A capture's own surprisal stored against the recompute's (`SKS1`): ~34 bits a position, not 64.

A capture that is not canonical (a user's own forward, `capture --no-canonical`) carries
surprisal from its own logits. The decoder recomputes the canonical surprisal anyway, and the
two agree to ~1e-6, so the float64 bit patterns share their sign, exponent and top ~20
mantissa bits. What is stored per position is the difference of the two bit patterns read as
integers (mod 2^64, so any pattern, NaN and -0.0 included, comes back exactly), zigzagged to
an unsigned z. z is written as its bit length L (a fixed-width field: L - L_min in w bits) and
the L - 1 bits under its leading one. All length fields come first, then all low bits, so
both halves decode with array operations instead of a loop over positions.

Byte layout (docs/FORMAT.md, "Surprisal against the recompute"):

    b"SKS1" | varint n | u8 L_min | u8 w | n fields of w bits | low bits | (zero padding)

Both bit blocks are MSB-first and each is padded with zero bits to a whole byte. A reader
refuses anything else: a wrong n, L past 64, nonzero padding, bytes left over.
"""

from __future__ import annotations

import numpy as np

from seqkv_codecs.bits import BitReader, BitWriter, bit_length
from seqkv_codecs.errors import CorruptStreamError
from seqkv_codecs.varint import decode_varint, encode_varint

MAGIC = b"SKS1"
WIDTH = 64


def encode_surprisal_delta(stored: np.ndarray, recomputed: np.ndarray) -> bytes:
    """The stream that turns `recomputed` (float64) into `stored` (float64), bit for bit."""
    a, b = _bits(stored), _bits(recomputed)
    if a.shape != b.shape:
        raise ValueError(f"{a.shape[0]} stored values against {b.shape[0]} recomputed")
    z = _zigzag(a - b)  # uint64 arithmetic wraps: the difference is exact mod 2^64
    lengths = bit_length(z)
    low = int(lengths.min()) if len(z) else 0
    width = int(lengths.max() - low).bit_length() if len(z) else 0
    fields = _pack((lengths - low).astype(np.uint64), np.full(len(z), width))
    rest = np.maximum(lengths - 1, 0)
    below = z & ((np.uint64(1) << rest.astype(np.uint64)) - np.uint64(1))
    return MAGIC + encode_varint(len(z)) + bytes([low, width]) + fields + _pack(below, rest)


def apply_surprisal_delta(data: bytes, recomputed: np.ndarray) -> np.ndarray:
    """`stored` again, from the stream and the same `recomputed` array (float64)."""
    if data[:4] != MAGIC:
        raise CorruptStreamError("not a surprisal stream (SKS1)")
    try:
        n, pos = decode_varint(data, 4)
    except CorruptStreamError:
        raise CorruptStreamError("the surprisal stream ends inside its count") from None
    b = _bits(recomputed)
    if n != len(b):
        raise CorruptStreamError(f"the surprisal stream holds {n} values, not {len(b)}")
    if pos + 2 > len(data):
        raise CorruptStreamError("the surprisal stream ends inside its header")
    low, width = data[pos], data[pos + 1]
    pos += 2
    if width > 7 or low > WIDTH:
        raise CorruptStreamError(f"the surprisal stream's lengths ({low}, {width} bits) are bad")
    fields, pos = _unpack(data, pos, np.full(n, width), "length fields")
    lengths = fields.astype(np.int64) + low
    if n and lengths.max() > WIDTH:
        raise CorruptStreamError("a surprisal difference is longer than 64 bits")
    rest = np.maximum(lengths - 1, 0)
    below, pos = _unpack(data, pos, rest, "low bits")
    if pos != len(data):
        raise CorruptStreamError(f"{len(data) - pos} bytes follow the surprisal stream")
    lead = np.where(lengths > 0, np.uint64(1) << rest.astype(np.uint64), np.uint64(0))
    out = b + _unzigzag(lead | below)
    return out.astype("<u8").view("<f8").astype(np.float64)


def _bits(values: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(values, dtype="<f8").reshape(-1).view("<u8").astype(np.uint64)


def _zigzag(d: np.ndarray) -> np.ndarray:
    signed = d.view(np.int64)
    return ((signed << np.int64(1)) ^ (signed >> np.int64(63))).view(np.uint64)


def _unzigzag(z: np.ndarray) -> np.ndarray:
    return (z >> np.uint64(1)) ^ (np.uint64(0) - (z & np.uint64(1)))


def _pack(values: np.ndarray, widths: np.ndarray) -> bytes:
    """The low `widths[i]` bits of every value, concatenated MSB-first, padded to a byte."""
    bits = BitWriter("msb")
    bits.varying(values, widths)
    return bits.getvalue()


def _unpack(data: bytes, pos: int, widths: np.ndarray, what: str) -> tuple[np.ndarray, int]:
    size = (int(widths.sum()) + 7) // 8
    bits = BitReader(data, "msb", f"the surprisal stream's {what}", start=pos, size=size)
    values = bits.varying(widths)
    bits.finish()
    return values, pos + size
