"""Token ids at a fixed bit width: the model-free token stream of a short run.

A static rANS stream (seqkv_codecs.entropy) pays for its symbol set, one frequency per
distinct symbol and its lane states before the first symbol: a few hundred bytes, more than
the ids themselves when a run holds ~100 tokens of a 50k vocabulary, nearly all distinct (an
agent's turn). Packed at the width of the largest id, they cost that width each and four
bytes of header. Writers keep whichever of the two is smaller; `read_ids` tells them apart by
the first byte (an entropy stream starts with its version, 1 or 2).

Layout (docs/format/TOKEN_STREAM.md, "Packed ids"): the tag byte 0x50, the id count as a
LEB128 varint, the width in bits (u8, 1..32), then the ids least significant bit first, each
`width` bits, in ceil(count * width / 8) bytes whose unused high bits are zero.
"""

from __future__ import annotations

import numpy as np

from seqkv_codecs.bits import BitReader, BitWriter
from seqkv_codecs.errors import CorruptStreamError
from seqkv_codecs.varint import decode_varint, encode_varint

TAG = 0x50
MAX_WIDTH = 32


def pack_ids(ids: np.ndarray) -> bytes:
    """The ids (non-negative integers below 2**32) at the width of the largest."""
    ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= 1 << MAX_WIDTH):
        raise ValueError("packed ids must lie in [0, 2**32)")
    width = max(1, int(ids.max()).bit_length()) if ids.size else 1
    writer = BitWriter("lsb")
    writer.fixed(ids.astype(np.uint64), width)
    return bytes([TAG]) + encode_varint(ids.size) + bytes([width]) + writer.getvalue()


def is_packed(data: bytes) -> bool:
    return bool(data) and data[0] == TAG


def unpack_ids(data: bytes, max_ids: int) -> np.ndarray:
    """The ids of a `pack_ids` stream: at most `max_ids`, the exact length the count and
    width need, and zero padding, else CorruptStreamError."""
    if not is_packed(data):
        raise CorruptStreamError("not a packed id stream")
    count, pos = decode_varint(data, 1)
    if count > max_ids:
        raise CorruptStreamError(f"packed ids claim {count} ids, more than the {max_ids} allowed")
    if pos >= len(data) or not 1 <= data[pos] <= MAX_WIDTH:
        raise CorruptStreamError("packed ids have no valid width")
    reader = BitReader(data, "lsb", "packed ids", start=pos + 1)
    ids = reader.fixed(count, data[pos])
    reader.finish()  # no byte beyond the last id's, and zero padding
    return ids.astype(np.int64)
