"""Lossless residual between captured K/V and K/V recomputed from the tokens.

Stored as bit-pattern differences (captured - recomputed, as unsigned integers of the
element width) because recomputation on another numeric path is usually off by a few ULPs
in a small share of elements: the difference is mostly 0 and otherwise small.

Stream (little-endian): magic ``b"SKR1"``, u8 version (1), u8 element width in bytes
(2 or 4), u8 number of 16-bit planes k (0..3), u8 reserved 0, u64 element count n,
u64 nonzero count z, then u32 length + bytes of the mask stream (rANS over {0, 1}, n symbols;
absent when z = 0), then for each plane, low first, u32 length + rANS stream (z symbols,
alphabet 65536) of ``(zigzag(diff) >> 16·j) & 0xFFFF`` for the nonzero elements in order.
"""

from __future__ import annotations

import struct

import numpy as np

from seqkv_codecs.errors import CorruptStreamError
from seqkv_codecs.framing import StreamReader, part

MAGIC = b"SKR1"
_HEAD = struct.Struct("<4sBBBBQQ")
_FIELDS = "<BBBQQ"  # _HEAD after its magic and version
_UINT = {2: np.uint16, 4: np.uint32}


def encode_residual(captured: np.ndarray, recomputed: np.ndarray) -> bytes:
    """Bit patterns of the same shape and unsigned dtype (uint16 or uint32)."""
    from seqkv_codecs.entropy import encode_symbols

    if captured.shape != recomputed.shape or captured.dtype != recomputed.dtype:
        raise ValueError("captured and recomputed K/V must have the same shape and dtype")
    width = captured.dtype.itemsize
    diff = captured.astype(np.int64).ravel() - recomputed.astype(np.int64).ravel()
    nonzero = diff != 0
    z = int(nonzero.sum())
    zig = np.where(diff[nonzero] >= 0, 2 * diff[nonzero], -2 * diff[nonzero] - 1).astype(np.uint64)
    planes = 0 if z == 0 else (int(zig.max()).bit_length() + 15) // 16
    out = [_HEAD.pack(MAGIC, 1, width, planes, 0, diff.size, z)]
    if z:
        streams = [encode_symbols(nonzero.astype(np.uint8), 2)] + [
            encode_symbols(
                ((zig >> np.uint64(16 * j)) & np.uint64(0xFFFF)).astype(np.uint16), 65536
            )
            for j in range(planes)
        ]
        out += [part(stream) for stream in streams]
    return b"".join(out)


def is_empty(data: bytes) -> bool:
    return len(data) >= _HEAD.size and _HEAD.unpack_from(data)[6] == 0


def apply_residual(data: bytes, recomputed: np.ndarray) -> np.ndarray:
    """Captured bit patterns = recomputed + residual."""
    from seqkv_codecs.entropy import decode_symbols

    reader = StreamReader(data, "residual")
    reader.opening(MAGIC, (1,))
    width, planes, _, n, z = reader.unpack(_FIELDS)
    if width != recomputed.dtype.itemsize:
        raise CorruptStreamError("not a residual stream of this element type")
    if n != recomputed.size or z > n or planes > 3:
        raise CorruptStreamError("residual stream does not match the recomputed K/V")
    flat = recomputed.astype(np.int64).ravel()
    if z:
        streams = reader.parts(1 + planes)
        reader.finish()
        mask = decode_symbols(streams[0], max_symbols=n).astype(bool)
        zig = np.zeros(z, np.uint64)
        for j, s in enumerate(streams[1:]):
            plane = decode_symbols(s, max_symbols=z)
            if plane.shape != (z,):
                raise CorruptStreamError("residual plane has the wrong length")
            zig |= plane.astype(np.uint64) << np.uint64(16 * j)
        if mask.shape != (n,) or int(mask.sum()) != z:
            raise CorruptStreamError("residual mask does not match its nonzero count")
        signed = np.where(
            zig % 2 == 0, (zig // 2).astype(np.int64), -((zig + 1) // 2).astype(np.int64)
        )
        flat[mask] += signed
    else:
        reader.finish()
    if flat.min(initial=0) < 0 or flat.max(initial=0) >= 1 << (8 * width):
        raise CorruptStreamError("residual moves a value out of range")
    return flat.astype(_UINT[width]).reshape(recomputed.shape)


# A residual resting on another session (trie archives): for positions [0, p) the reference is
# that session's restored K/V instead of the recompute. Sessions of one segment that share a
# prefix whose K/V are the same bits (llama.cpp slots of one system prompt) then store the
# prefix's residual once. An older reader finds an unknown magic and refuses the part.
BASED_MAGIC = b"SKB1"
ROUNDING_MAGIC = b"SKR2"  # seqkv_codecs.rounding_residual.MAGIC (which imports nothing here)
_BASED = struct.Struct("<4sBBHII")  # magic, version 1, reserved u8, u16; base local, p
_BASED_FIELDS = "<BHII"  # _BASED after its magic and version


def encode_based(base_local: int, positions: int, inner: bytes) -> bytes:
    """`inner` (an SKR1 or SKR2 stream against the spliced reference) resting on session
    `base_local` of the same segment for its first `positions` positions."""
    return _BASED.pack(BASED_MAGIC, 1, 0, 0, base_local, positions) + inner


def parse_based(data: bytes) -> tuple[int, int, bytes]:
    """(base session's local index, shared positions, the inner SKR1 stream)."""
    reader = StreamReader(data, "based residual")
    reader.opening(BASED_MAGIC, (1,))
    r1, r2, base, positions = reader.unpack(_BASED_FIELDS)
    if r1 or r2:
        raise CorruptStreamError("not a based residual stream of version 1")
    inner = bytes(reader.rest())
    if inner[:4] not in (MAGIC, ROUNDING_MAGIC):
        raise CorruptStreamError("based residual stream does not hold an exact residual")
    return base, positions, inner
