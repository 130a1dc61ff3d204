"""Range coder with 64-bit state and byte output, for total frequencies 2**P, P <= 31.

Queue order: the first symbol encoded is the first decoded. The range never drops below
2**56, so ``range >> P`` keeps at least 25 bits and truncation costs < 2**-25 bits per
symbol. Pure Python integers: one call per token is cheap next to one model step.
Byte-level spec: docs/format/RANGE_CODER.md.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable, Iterator
from operator import index

import numpy as np

from seqkv_codecs.errors import CodecError, CorruptStreamError
from seqkv_codecs.sequential.probability import MAX_PRECISION_BITS, cumulative

STATE_BYTES = 8
_TOP = 1 << 64
_MASK = _TOP - 1
_BOTTOM = 1 << 56  # renormalise (shift a byte out) while range < 2**56
_PAD = STATE_BYTES - 1  # the decoder reads exactly this many zero bytes past the end


def _check_interval(cum_low: int, freq: int, precision_bits: int) -> None:
    if not 1 <= precision_bits <= MAX_PRECISION_BITS:
        raise CodecError(f"precision_bits must be in 1..{MAX_PRECISION_BITS}, got {precision_bits}")
    if cum_low < 0 or freq < 1 or cum_low + freq > 1 << precision_bits:
        raise CodecError(f"interval [{cum_low}, {cum_low + freq}) is empty or outside 2**P")


class RangeEncoder:
    """Encodes intervals ``[cum_low, cum_low + freq)`` of ``[0, 2**P)`` into bytes."""

    __slots__ = ("_low", "_out", "_range")

    def __init__(self) -> None:
        self._low = 0
        self._range = _MASK
        self._out: bytearray | None = bytearray()

    def _carry(self) -> None:
        """Add 1 to the bytes already written; cannot run off the front (see the spec)."""
        out = self._out
        i = len(out) - 1
        while out[i] == 0xFF:
            out[i] = 0
            i -= 1
        out[i] += 1

    def encode(self, cum_low: int, freq: int, precision_bits: int) -> None:
        cum_low, freq, precision_bits = index(cum_low), index(freq), index(precision_bits)
        _check_interval(cum_low, freq, precision_bits)
        if self._out is None:
            raise CodecError("encode() after finish(); start a new RangeEncoder")
        r = self._range >> precision_bits
        low = self._low + r * cum_low
        rng = r * freq
        if low >= _TOP:
            low -= _TOP
            self._carry()
        while rng < _BOTTOM:
            self._out.append(low >> 56)
            low = (low << 8) & _MASK
            rng <<= 8
        self._low, self._range = low, rng

    def finish(self) -> bytes:
        """Flush one byte: the top byte of the smallest multiple of 2**56 >= low."""
        if self._out is None:
            raise CodecError("finish() called twice")
        value = -(-self._low // _BOTTOM) * _BOTTOM
        if value >= _TOP:
            value -= _TOP
            self._carry()
        self._out.append(value >> 56)
        data, self._out = bytes(self._out), None
        return data


class RangeDecoder:
    """Decodes what :class:`RangeEncoder` wrote; every inconsistency is a CorruptStreamError."""

    __slots__ = ("_data", "_pos", "_range", "_x")

    def __init__(self, data: bytes) -> None:
        self._data = bytes(data) + bytes(_PAD)
        self._pos = 0
        self._range = _MASK
        self._x = 0  # code - low: the offset of the stream's value inside the current interval
        self._shift_in(STATE_BYTES)

    def _shift_in(self, count: int) -> None:
        end = self._pos + count
        if end > len(self._data):
            raise CorruptStreamError("range-coded stream is truncated: read past its end")
        self._x = (self._x << 8 * count) | int.from_bytes(self._data[self._pos : end], "big")
        self._pos = end

    def peek(self, precision_bits: int) -> int:
        """The target in [0, 2**P) that the next symbol's interval must contain."""
        precision_bits = index(precision_bits)
        if not 1 <= precision_bits <= MAX_PRECISION_BITS:
            raise CodecError(f"precision_bits must be in 1..{MAX_PRECISION_BITS}")
        target = self._x // (self._range >> precision_bits)
        if target >> precision_bits:
            raise CorruptStreamError("range-coded stream is corrupt: target outside 2**P")
        return target

    def advance(self, cum_low: int, freq: int, precision_bits: int) -> None:
        """Consume the symbol whose interval ``[cum_low, cum_low + freq)`` holds peek()."""
        cum_low, freq, precision_bits = index(cum_low), index(freq), index(precision_bits)
        _check_interval(cum_low, freq, precision_bits)
        r = self._range >> precision_bits
        x = self._x - r * cum_low
        rng = r * freq
        if not 0 <= x < rng:
            raise CorruptStreamError(
                "decoded target is outside the given interval: the frequency table differs "
                "from the encoder's, or the stream is corrupt"
            )
        shifts = 0
        while rng < _BOTTOM:
            rng <<= 8
            shifts += 1
        self._x, self._range = x, rng
        if shifts:
            self._shift_in(shifts)

    def finish_check(self) -> None:
        """Raise unless every byte was read and the final state is the encoder's flush."""
        unread = len(self._data) - self._pos
        if unread:
            raise CorruptStreamError(f"range-coded stream has {unread} bytes of trailing data")
        if self._x >= _BOTTOM:
            raise CorruptStreamError("range-coded stream does not end with the encoder's flush")


def _row_cdf(row: np.ndarray, precision_bits: int) -> np.ndarray:
    f = np.asarray(row)
    if f.ndim != 1 or f.dtype.kind not in "iu" or f.size == 0:
        raise CodecError(f"a frequency row must be a non-empty 1-D integer array, got {f.shape}")
    if f.min() < 0:
        raise CodecError("a frequency row has negative entries")
    cdf = cumulative(f)
    if cdf[-1] != 1 << precision_bits:
        raise CodecError(f"a frequency row sums to {cdf[-1]}, not 2**{precision_bits}")
    return cdf


def encode_symbol(enc: RangeEncoder, freqs: np.ndarray, symbol: int, precision_bits: int) -> None:
    """Encode ``symbol`` under one frequency row (V,) that sums to 2**P."""
    cdf = _row_cdf(freqs, precision_bits)
    symbol = index(symbol)
    if not 0 <= symbol < cdf.size - 1:
        raise CodecError(f"symbol {symbol} is outside the table of {cdf.size - 1} symbols")
    low = int(cdf[symbol])
    enc.encode(low, int(cdf[symbol + 1]) - low, precision_bits)


def decode_symbol(dec: RangeDecoder, freqs: np.ndarray, precision_bits: int) -> int:
    """Decode one symbol under the same row the encoder used."""
    cdf = _row_cdf(freqs, precision_bits)
    symbol = int(np.searchsorted(cdf, dec.peek(precision_bits), side="right")) - 1
    low = int(cdf[symbol])
    dec.advance(low, int(cdf[symbol + 1]) - low, precision_bits)
    return symbol


def _next_row(rows: Iterator[np.ndarray], symbol: int | None) -> np.ndarray | None:
    """Next row, or None when exhausted; a generator is sent the symbol just coded."""
    try:
        if symbol is not None and isinstance(rows, Generator):
            return rows.send(symbol)
        return next(rows)
    except StopIteration:
        return None


def encode_with_tables(
    symbols: Iterable[int], freq_rows: Iterable[np.ndarray], precision_bits: int = 24
) -> bytes:
    """Encode symbol i under row i (shape (V,), summing to 2**P); lengths must match.

    A generator of rows is sent each symbol after it is coded (``symbol = yield row``), so
    the same adaptive model function drives :func:`decode_with_tables`.
    """
    syms = np.asarray(symbols, dtype=np.int64).reshape(-1).tolist()
    rows = iter(freq_rows)
    enc = RangeEncoder()
    row = _next_row(rows, None)
    for i, symbol in enumerate(syms):
        if row is None:
            raise CodecError(f"{len(syms)} symbols but only {i} frequency rows")
        encode_symbol(enc, row, symbol, precision_bits)
        row = _next_row(rows, symbol)
    if row is not None:
        raise CodecError(f"more frequency rows than the {len(syms)} symbols")
    return enc.finish()


def decode_with_tables(
    data: bytes, freq_rows_iter: Iterable[np.ndarray], precision_bits: int = 24
) -> np.ndarray:
    """Decode one symbol per row and check the flush; returns int64 symbols.

    Rows are pulled lazily, one after each decoded symbol; a generator is sent that symbol,
    so row i may depend on symbols < i (the language-model case).
    """
    dec = RangeDecoder(data)
    rows = iter(freq_rows_iter)
    out: list[int] = []
    row = _next_row(rows, None)
    while row is not None:
        out.append(decode_symbol(dec, row, precision_bits))
        row = _next_row(rows, out[-1])
    dec.finish_check()
    return np.array(out, dtype=np.int64)
