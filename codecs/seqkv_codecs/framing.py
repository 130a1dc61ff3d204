"""Stream framing: the one reader and writer of magics, versions, length-prefixed parts, CRCs.

Every binary stream of the codec library opens with a few ASCII bytes naming it and a u8
layout version, and many hold parts as a little-endian u32 byte count and the bytes; some
guard their header (or the whole stream) with a CRC32 (zlib's). `StreamReader` reads such a
stream front to back and turns every shortfall into one `CorruptStreamError` that names the
stream; `part` and `with_crc32` write what it reads.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Collection
from typing import Any

import numpy as np

from seqkv_codecs.errors import CorruptStreamError
from seqkv_codecs.varint import MAX_VARINT_BYTES, decode_varint

LENGTH = struct.Struct("<I")  # a part's byte count
CRC32 = struct.Struct("<I")


def part(payload: bytes) -> bytes:
    """Frame ``payload`` as a part that `StreamReader.part` reads back."""
    return LENGTH.pack(len(payload)) + payload


def with_crc32(data: bytes) -> bytes:
    """``data`` followed by the CRC32 of it, as `StreamReader.crc32` checks it."""
    return data + CRC32.pack(zlib.crc32(data))


class StreamReader:
    """Reads a stream front to back; every shortfall becomes a `CorruptStreamError`.

    ``trailing_crc32``: the stream ends in a CRC32 of everything before it, checked here,
    before anything is parsed; the reader then ends before it.
    """

    def __init__(self, data: bytes | memoryview, what: str, *, trailing_crc32: bool = False):
        self._buf = memoryview(data).cast("B")
        self._pos = 0
        self._what = what
        if trailing_crc32:
            end = len(self._buf) - CRC32.size
            if end < 0 or zlib.crc32(self._buf[:end]) != CRC32.unpack(self._buf[end:])[0]:
                raise CorruptStreamError(f"{what} stream is truncated or failed its CRC")
            self._buf = self._buf[:end]

    @property
    def position(self) -> int:
        """Bytes read so far."""
        return self._pos

    @property
    def left(self) -> int:
        """Bytes not read yet."""
        return len(self._buf) - self._pos

    def take(self, n: int) -> memoryview:
        """The next ``n`` bytes."""
        if n < 0 or self._pos + n > len(self._buf):
            raise CorruptStreamError(
                f"{self._what} stream is truncated: needs {n} bytes at offset {self._pos}, "
                f"only {len(self._buf) - self._pos} left"
            )
        out = self._buf[self._pos : self._pos + n]
        self._pos += n
        return out

    def rest(self) -> memoryview:
        """Everything not read yet."""
        return self.take(self.left)

    def unpack(self, fmt: str) -> tuple[Any, ...]:
        """The next fixed-size fields, `struct` format ``fmt`` (give the byte order)."""
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))

    def array(self, dtype: str, count: int) -> np.ndarray:
        """The next ``count`` elements of little-endian ``dtype`` (e.g. ``"<f2"``), as a copy."""
        dt = np.dtype(dtype)
        return np.frombuffer(self.take(count * dt.itemsize), dtype=dt).copy()

    def opening(self, magic: bytes, versions: Collection[int]) -> int:
        """The stream's magic bytes and u8 layout version, which must be one of ``versions``."""
        got = bytes(self.take(len(magic)))
        if got != magic:
            raise CorruptStreamError(
                f"not a {self._what} stream: magic {got!r}, expected {magic!r}"
            )
        (version,) = self.unpack("<B")
        if version not in versions:
            known = " and ".join(str(v) for v in sorted(versions))
            raise CorruptStreamError(
                f"{self._what} stream version {version} is not supported "
                f"(this seqkv reads version {known})"
            )
        return version

    def varint(self, max_bytes: int = MAX_VARINT_BYTES) -> int:
        """The next unsigned LEB128 varint (varint.py)."""
        try:
            value, self._pos = decode_varint(self._buf, self._pos, max_bytes=max_bytes)
        except CorruptStreamError as exc:
            raise CorruptStreamError(f"{self._what} stream: {exc}") from None
        return value

    def part(self) -> memoryview:
        """A length-prefixed part: u32 byte count, then the bytes."""
        (n,) = self.unpack("<I")
        return self.take(n)

    def parts(self, count: int) -> list[memoryview]:
        """``count`` length-prefixed parts, back to back."""
        return [self.part() for _ in range(count)]

    def crc32(self) -> None:
        """The next u32 must be the CRC32 of everything before it."""
        expected = zlib.crc32(self._buf[: self._pos])
        (stored,) = self.unpack("<I")
        if stored != expected:
            raise CorruptStreamError(f"{self._what} stream header failed its CRC: it is damaged")

    def finish(self) -> None:
        """Trailing bytes mean the stream is not what the header says it is."""
        if self._pos != len(self._buf):
            raise CorruptStreamError(
                f"{self._what} stream has {len(self._buf) - self._pos} unexpected trailing bytes"
            )
