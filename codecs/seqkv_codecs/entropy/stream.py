"""Byte layout of an entropy stream, shared by the numpy and torch coders
(docs/format/ENTROPY_STREAM.md).

Both backends hand :func:`pack` the same table, lane states and words, so they write the same
bytes. :func:`unpack` checks every size against the length of the data before it allocates
anything, so a corrupt header costs a ``CorruptStreamError``, not memory.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from seqkv_codecs.entropy.freq import MAX_PRECISION, table_from_counts
from seqkv_codecs.errors import CorruptStreamError

VERSION = 1
MAX_ALPHABET = 1 << 16
MAX_STEPS = 1 << 16  # symbols per lane; bounds n_symbols by 2**16 * lanes <= 2**14 * len(data)
DEFAULT_MAX_LANES = 1 << 14
# ~64 bits of lane state per 512 symbols: see docs/format/ENTROPY_STREAM.md
SYMBOLS_PER_LANE = 1 << 9
HEADER = struct.Struct("<BBBBIQIIQ")  # version, precision, set mode, freq width, A, n, K, L, W
STATE_LOW = 1 << 16

LaneCoder = Callable[[np.ndarray, int, int], tuple[np.ndarray, np.ndarray]]


@dataclass(frozen=True)
class Stream:
    """A parsed, validated stream: what a backend needs to decode it."""

    alphabet_size: int
    precision: int
    n_symbols: int
    freqs: np.ndarray  # int64, one entry per alphabet symbol, 0 where absent
    states: np.ndarray  # uint32, one per lane: the decoder's starting states
    words: np.ndarray  # uint16, in decode order


def symbol_dtype(alphabet_size: int) -> np.dtype:
    """Decoded symbols are uint8 for alphabets up to 256 symbols, uint16 above."""
    return np.dtype(np.uint8 if alphabet_size <= 256 else np.uint16)


def check_alphabet(alphabet_size: int) -> int:
    if not isinstance(alphabet_size, int | np.integer) or not 1 <= alphabet_size <= MAX_ALPHABET:
        raise ValueError(
            f"alphabet_size must be an integer in 1..{MAX_ALPHABET}, got {alphabet_size!r}"
        )
    return int(alphabet_size)


def check_range(low: int, high: int, alphabet_size: int) -> None:
    if low < 0 or high >= alphabet_size:
        raise ValueError(
            f"symbols must lie in [0, {alphabet_size}); found values in [{low}, {high}]"
        )


def symbol_count(data: bytes | memoryview) -> int:
    """The symbol count a stream's header claims (0 if it is too short to have a header):
    enough to choose where to decode it; `unpack` checks it."""
    data = memoryview(data).cast("B")
    return HEADER.unpack_from(data)[5] if len(data) >= HEADER.size else 0


def default_lanes(n: int) -> int:
    """Lanes for ``n`` symbols: ~512 symbols per lane, at most 16384 lanes unless n needs more."""
    return max(1, min(DEFAULT_MAX_LANES, n // SYMBOLS_PER_LANE), -(-n // MAX_STEPS))


def step_shape(n: int, lanes: int) -> tuple[int, int]:
    """(steps, lanes active in the last step) when ``n`` symbols are dealt round-robin."""
    steps = -(-n // lanes)
    return steps, n - (steps - 1) * lanes


def encode_stream(
    counts: np.ndarray, n: int, alphabet_size: int, lanes: int | None, coder: LaneCoder
) -> bytes:
    """Build the table from ``counts``, run ``coder(freqs, precision, lanes)``, pack the result."""
    lanes = default_lanes(n) if lanes is None else int(lanes)
    low, high = max(1, -(-n // MAX_STEPS)), max(n, 1)
    if not low <= lanes <= high:
        raise ValueError(f"lanes must be in {low}..{high} for {n} symbols, got {lanes}")
    precision, freqs = table_from_counts(counts)
    if precision == 0:  # zero or one distinct symbol: the table alone says everything
        return pack(alphabet_size, 0, n, freqs, np.empty(0, np.uint32), np.empty(0, np.uint16))
    states, words = coder(freqs, precision, lanes)
    return pack(alphabet_size, precision, n, freqs, states, words)


def pack(
    alphabet_size: int,
    precision: int,
    n: int,
    freqs: np.ndarray,
    states: np.ndarray,
    words: np.ndarray,
) -> bytes:
    present = np.flatnonzero(freqs)
    wide = alphabet_size > 256
    list_bytes = present.size * (2 if wide else 1)
    bitmap = list_bytes > -(-alphabet_size // 8)
    if bitmap:
        bits = np.zeros(alphabet_size, dtype=np.uint8)
        bits[present] = 1
        symbol_set = np.packbits(bits, bitorder="little").tobytes()
    else:
        symbol_set = present.astype("<u2" if wide else "u1").tobytes()
    minus_one = freqs[present] - 1
    width = 2 if minus_one.size and minus_one.max() > 0xFF else 1
    head = HEADER.pack(
        VERSION,
        precision,
        int(bitmap),
        width,
        alphabet_size,
        n,
        present.size,
        states.size,
        words.size,
    )
    return b"".join(
        (
            head,
            symbol_set,
            minus_one.astype("<u2" if width == 2 else "u1").tobytes(),
            states.astype("<u4").tobytes(),
            words.astype("<u2").tobytes(),
        )
    )


def unpack(data: bytes | memoryview, max_symbols: int | None = None) -> Stream:
    """Parse and validate ``data``; raise CorruptStreamError naming the first inconsistency."""
    data = memoryview(data).cast("B")
    if len(data) < HEADER.size:
        raise CorruptStreamError(
            f"entropy stream truncated: {len(data)} bytes, the header alone needs {HEADER.size}"
        )
    version, precision, bitmap, width, alphabet, n, k, lanes, n_words = HEADER.unpack_from(data)
    if version != VERSION:
        raise CorruptStreamError(
            f"entropy stream version {version} is not supported (expected {VERSION})"
        )
    if not 1 <= alphabet <= MAX_ALPHABET or bitmap > 1 or width not in (1, 2) or k > alphabet:
        raise CorruptStreamError(
            f"entropy stream header is inconsistent: alphabet {alphabet}, {k} symbols, "
            f"set mode {bitmap}, frequency width {width}"
        )
    if max_symbols is not None and n > max_symbols:
        raise CorruptStreamError(
            f"entropy stream claims {n} symbols, more than the {max_symbols} expected"
        )
    if k <= 1:
        trivial = precision == 0 and lanes == 0 and n_words == 0 and (n == 0) == (k == 0)
    else:
        trivial = False
        coded = 1 <= precision <= MAX_PRECISION and k <= 1 << precision and 1 <= lanes <= n
        if not coded or -(-n // lanes) > MAX_STEPS or n_words > n:
            raise CorruptStreamError(
                f"entropy stream header is inconsistent: {n} symbols, {k} distinct, "
                f"precision {precision}, {lanes} lanes, {n_words} words"
            )
    if k <= 1 and not trivial:
        raise CorruptStreamError(f"entropy stream with {k} distinct symbols has a coded payload")
    set_bytes = -(-alphabet // 8) if bitmap else k * (2 if alphabet > 256 else 1)
    expected = HEADER.size + set_bytes + k * width + 4 * lanes + 2 * n_words
    if expected != len(data):
        raise CorruptStreamError(
            f"entropy stream is {len(data)} bytes but its header describes {expected} bytes"
        )
    offset = HEADER.size
    present = _symbol_set(data, offset, set_bytes, bitmap, alphabet, k)
    offset += set_bytes
    freqs = np.zeros(alphabet, dtype=np.int64)
    freqs[present] = (
        np.frombuffer(data, "<u2" if width == 2 else "u1", k, offset).astype(np.int64) + 1
    )
    offset += k * width
    if k and int(freqs.sum()) != 1 << precision:
        raise CorruptStreamError(f"entropy stream frequencies do not sum to 2**{precision}")
    states = np.frombuffer(data, "<u4", lanes, offset).astype(np.uint32)
    offset += 4 * lanes
    if lanes and int(states.min()) < STATE_LOW:
        raise CorruptStreamError("entropy stream has a lane state below 2**16")
    words = np.frombuffer(data, "<u2", n_words, offset).astype(np.uint16)
    return Stream(alphabet, precision, n, freqs, states, words)


def _symbol_set(
    data: memoryview, offset: int, size: int, bitmap: int, alphabet: int, k: int
) -> np.ndarray:
    raw = np.frombuffer(data, np.uint8, size, offset)
    if bitmap:
        bits = np.unpackbits(raw, bitorder="little")
        present = np.flatnonzero(bits[:alphabet])
        if present.size != k or bits[alphabet:].any():
            raise CorruptStreamError(f"entropy stream symbol bitmap does not hold {k} symbols")
        return present
    present = raw.view("<u2" if alphabet > 256 else "u1").astype(np.int64)
    if k and (present[-1] >= alphabet or np.any(np.diff(present) <= 0)):
        raise CorruptStreamError(
            "entropy stream symbol list is not strictly increasing within the alphabet"
        )
    return present
