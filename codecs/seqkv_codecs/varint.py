"""Unsigned LEB128 varints (and zigzag for signed values), read with bounds checks.

Several seqkv formats (trie tables, near-duplicate edit streams and their part header) store
counts and lengths as varints; they share this one codec so that they cannot drift apart.

A varint holds an unsigned integer in 7-bit groups, least significant group first; every
byte but the last has its high bit (0x80) set. 0 is the single byte 0x00, 300 is ``AC 02``.
Writers emit the shortest form; readers also accept padded forms (``80 00`` reads as 0) up to
``max_bytes`` bytes, which is where a damaged stream stops instead of growing a number
forever. Reading raises `CorruptStreamError` when the data ends inside a varint or a varint
runs past ``max_bytes``; callers that need their own wording catch it.
"""

from __future__ import annotations

from seqkv_codecs.errors import CorruptStreamError

MAX_VARINT_BYTES = 10  # enough for any u64; a reader may allow fewer


def encode_varint(value: int) -> bytes:
    """The shortest varint of ``value`` (>= 0; there is no upper limit)."""
    if value < 0:
        raise ValueError(f"a varint holds a non-negative integer, got {value}")
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def decode_varint(
    data: bytes, pos: int = 0, *, max_bytes: int = MAX_VARINT_BYTES
) -> tuple[int, int]:
    """(value, position after it) of the varint at ``data[pos]``.

    Raises `CorruptStreamError` if ``data`` ends inside the varint or it is longer than
    ``max_bytes`` bytes (the value itself is not bounded: check it where it is used).
    """
    value, shift, stop = 0, 0, pos + max_bytes
    while True:
        if pos >= len(data):
            raise CorruptStreamError("a varint runs past the end of the data")
        if pos >= stop:
            raise CorruptStreamError(f"a varint is longer than {max_bytes} bytes")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def zigzag_encode(value: int) -> int:
    """A signed integer as an unsigned one: 0, -1, 1, -2, ... become 0, 1, 2, 3, ..."""
    return value * 2 if value >= 0 else -value * 2 - 1


def zigzag_decode(value: int) -> int:
    """The inverse of `zigzag_encode` (``value`` >= 0)."""
    return value >> 1 if value % 2 == 0 else -((value + 1) >> 1)
