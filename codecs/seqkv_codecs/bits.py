"""Bit strings: one writer and one reader for every stream that packs numbers below a byte.

A stream's bits are written in one of two orders, a parameter of both sides:

* ``"msb"`` - each number's bits most significant first, and the first bit of a byte is its
  top bit (0x80): bits 1, 0, 1, 1 are the byte ``0b10110000``;
* ``"lsb"`` - each number's bits least significant first, and the first bit of a byte is its
  low bit (0x01): bits 1, 0, 1, 1 are the byte ``0b00001101``.

The last byte is padded with zero bits. Numbers are unsigned, up to 64 bits. Both sides work
on numpy arrays a block of numbers at a time, so the work arrays stay bounded (a block's bits,
one byte each) however long the stream; the writer keeps only the finished bytes.

A reader may be bounded to a byte range of a larger buffer; reading past its end, or a stream
whose last bits are not zero padding, is refused with `CorruptStreamError` naming ``what``.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from seqkv_codecs.errors import CorruptStreamError

BitOrder = Literal["msb", "lsb"]
WIDTH = 64  # the widest number a field may hold
BLOCK = 1 << 14  # numbers per (numbers, 64) bit matrix: ~1 MB of work arrays at most
_WINDOW = 1 << 20  # bits scanned at a time for unary codes
_NUMPY_ORDER = {"msb": "big", "lsb": "little"}
_COLUMNS = np.arange(WIDTH)


def bit_length(values: np.ndarray) -> np.ndarray:
    """Bits needed for each unsigned value (0 for 0), as int64."""
    z = np.asarray(values).astype(np.uint64)
    out = np.zeros(z.shape, np.int64)
    for shift in (32, 16, 8, 4, 2, 1):  # binary search on every element at once
        big = (z >> np.uint64(shift)) > 0
        out += big * shift
        z = np.where(big, z >> np.uint64(shift), z)
    return out + (z > 0)


def _numpy_order(order: str) -> str:
    if order not in _NUMPY_ORDER:
        raise ValueError(f"bit order is 'msb' or 'lsb', not {order!r}")
    return _NUMPY_ORDER[order]


def _kept(widths: np.ndarray, order: str) -> np.ndarray:
    """Which of a number's 64 bit columns (in stream order) its field keeps."""
    w = widths[:, None]
    return _COLUMNS[None, :] >= WIDTH - w if order == "msb" else _COLUMNS[None, :] < w


class BitWriter:
    """Appends unsigned numbers as bit fields; `getvalue` is the padded bytes."""

    def __init__(self, order: BitOrder) -> None:
        self._order = order
        self._numpy_order = _numpy_order(order)
        self._bytes = bytearray()
        self._carry = np.zeros(0, np.uint8)  # the last bits, fewer than 8, one byte each

    def _append(self, bits: np.ndarray) -> None:
        if self._carry.size:
            bits = np.concatenate([self._carry, bits])
        whole = bits.size - bits.size % 8
        self._bytes += np.packbits(bits[:whole], bitorder=self._numpy_order).tobytes()
        self._carry = bits[whole:].copy()

    def varying(self, values: np.ndarray, widths: np.ndarray) -> None:
        """Each value's low widths[i] bits, one value after another."""
        values, widths = np.asarray(values), np.asarray(widths, np.int64)
        dtype = ">u8" if self._order == "msb" else "<u8"
        for at in range(0, values.size, BLOCK):
            v = values[at : at + BLOCK].astype(dtype).view(np.uint8).reshape(-1, 8)
            matrix = np.unpackbits(v, axis=1, bitorder=self._numpy_order)
            self._append(matrix[_kept(widths[at : at + BLOCK], self._order)])

    def fixed(self, values: np.ndarray, width: int) -> None:
        """Each value's low `width` bits."""
        self.varying(values, np.full(np.size(values), width, np.int64))

    def unary(self, q: np.ndarray) -> None:
        """Each value q as q zeros and a one."""
        q = np.asarray(q, np.int64)
        for at in range(0, q.size, BLOCK):
            block = q[at : at + BLOCK]
            chunk = np.zeros(int(block.sum()) + block.size, np.uint8)
            chunk[np.cumsum(block + 1) - 1] = 1
            self._append(chunk)

    def gamma(self, values: np.ndarray) -> None:
        """Values >= 0 as their bit lengths L in unary, then (after all of them) the L - 1 bits
        of each below its leading one."""
        lengths = bit_length(values)
        self.unary(lengths)
        self.varying(values, np.maximum(lengths - 1, 0))

    def getvalue(self) -> bytes:
        tail = np.packbits(self._carry, bitorder=self._numpy_order).tobytes()
        return bytes(self._bytes) + tail


class BitReader:
    """Reads what a `BitWriter` of the same order wrote, from ``data[start:start + size]``."""

    def __init__(
        self,
        data: bytes | memoryview,
        order: BitOrder,
        what: str,
        start: int = 0,
        size: int | None = None,
    ) -> None:
        self._numpy_order = _numpy_order(order)
        self._order = order
        self._what = what  # names the bits in every refusal: "<what> end early"
        buf = np.frombuffer(data, np.uint8)
        size = buf.size - start if size is None else size
        if start < 0 or size < 0 or start + size > buf.size:
            raise CorruptStreamError(f"{what} end early")
        self._bytes = buf[start : start + size]
        self._pos = 0
        self._end = 8 * size

    def _bits(self, pos: int, count: int) -> np.ndarray:
        """Bits [pos, pos + count), one byte each (the caller checked the range)."""
        first, skip = pos >> 3, pos & 7
        chunk = self._bytes[first : (pos + count + 7) >> 3]
        return np.unpackbits(chunk, bitorder=self._numpy_order)[skip : skip + count]

    def varying(self, widths: np.ndarray) -> np.ndarray:
        """Values of widths[i] bits each (uint64)."""
        widths = np.asarray(widths, np.int64)
        if widths.size and (widths.min() < 0 or widths.max() > WIDTH):
            raise CorruptStreamError(f"{self._what} hold a field wider than {WIDTH} bits")
        if self._pos + int(widths.sum()) > self._end:
            raise CorruptStreamError(f"{self._what} end early")
        dtype = ">u8" if self._order == "msb" else "<u8"
        out = np.zeros(widths.size, np.uint64)
        for at in range(0, widths.size, BLOCK):
            w = widths[at : at + BLOCK]
            total = int(w.sum())
            matrix = np.zeros((w.size, WIDTH), np.uint8)
            matrix[_kept(w, self._order)] = self._bits(self._pos, total)
            self._pos += total
            packed = np.packbits(matrix, axis=1, bitorder=self._numpy_order)
            out[at : at + BLOCK] = packed.view(dtype).reshape(-1)
        return out

    def fixed(self, count: int, width: int) -> np.ndarray:
        """`count` values of `width` bits each (uint64)."""
        return self.varying(np.full(count, width, np.int64))

    def unary(self, count: int) -> np.ndarray:
        """`count` unary codes (int64): the zeros before each one."""
        ones, found, pos = [], 0, self._pos
        while found < count:
            if pos >= self._end:
                raise CorruptStreamError(f"{self._what} end inside a gap")
            stop = min(self._end, pos + _WINDOW)
            hits = np.flatnonzero(self._bits(pos, stop - pos))[: count - found] + pos
            ones.append(hits)
            found += hits.size
            pos = stop
        if not count:
            return np.zeros(0, np.int64)
        at = np.concatenate(ones).astype(np.int64)
        out = np.diff(at, prepend=self._pos - 1) - 1
        self._pos = int(at[-1]) + 1
        return out

    def gamma(self, count: int, max_length: int = WIDTH) -> np.ndarray:
        """`count` values written by `BitWriter.gamma` (uint64), each at most `max_length` bits."""
        lengths = self.unary(count)
        if lengths.max(initial=0) > max_length:
            raise CorruptStreamError(f"{self._what} hold a number longer than {max_length} bits")
        low = self.varying(np.maximum(lengths - 1, 0))
        shift = np.maximum(lengths - 1, 0).astype(np.uint64)
        return np.where(lengths >= 1, np.uint64(1) << shift, np.uint64(0)) | low

    def finish(self) -> None:
        """The bits end in the last byte, and what is left of it is zero padding."""
        left = self._end - self._pos
        if left >= 8:
            raise CorruptStreamError(f"{self._what} are followed by {left} trailing bits")
        if left and self._bits(self._pos, left).any():
            raise CorruptStreamError(f"{self._what} end in nonzero padding")
