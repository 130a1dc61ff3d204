"""Entropy stream version 2: alphabets past 65,536 symbols, as version-1 streams of 16-bit planes.

Version 1's table holds at most 2**16 symbols (a u16 symbol list, precision at most 16), and
the token ids of 150k-260k-token vocabularies (Qwen, Llama 3, Gemma) do not fit it. Version 2
codes each symbol's high 16 bits as one version-1 stream, then the low 16 bits of the symbols
of each high value as a version-1 stream of their own: the low plane is coded *given* the
high one, so the stream costs what one table over the whole alphabet would
(n·H(s) = n·H(high) + Σ_h n_h·H(low | high = h)), plus one table per high value in use.
Layout: docs/format/ENTROPY_STREAM.md, "Version 2". `encode_symbols` writes it only for alphabets
past 65,536, so every stream a smaller alphabet gives keeps its version-1 bytes.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

import numpy as np

from seqkv_codecs.entropy import stream
from seqkv_codecs.errors import CorruptStreamError
from seqkv_codecs.framing import StreamReader, part

VERSION = 2
PLANE_BITS = 16
PLANE = 1 << PLANE_BITS
MAX_ALPHABET = (1 << 32) - 1  # the header's u32; ids past it exist in no vocabulary
# version, three reserved zero bytes, alphabet, symbol count: the offsets of version 1's own
# version, alphabet and count, so `stream.symbol_count` reads either version's count
HEADER = struct.Struct("<B3sIQ")

PlaneCoder = Callable[[np.ndarray, int], bytes]  # (symbols, alphabet) -> a version-1 stream
PlaneDecoder = Callable[[memoryview, int], np.ndarray]  # (stream, count) -> its symbols


def plane_alphabet(alphabet: int, high: int) -> int:
    """The low plane's alphabet under high value ``high``: 2**16, less in the last block."""
    return min(PLANE, alphabet - (high << PLANE_BITS))


def encode(symbols: np.ndarray, alphabet: int, code: PlaneCoder) -> bytes:
    """The version-2 stream of ``symbols`` (1-D, checked to lie in ``[0, alphabet)``), each
    plane coded by ``code`` (a version-1 coder on the caller's backend)."""
    high = (symbols >> PLANE_BITS).astype(np.int64)
    low = (symbols & (PLANE - 1)).astype(np.uint16)
    blocks = -(-alphabet // PLANE)
    parts = [code(high, blocks)]
    order = np.argsort(high, kind="stable")  # the symbols of each high value, in stream order
    counts = np.bincount(high, minlength=blocks)
    start = 0
    for h in np.flatnonzero(counts).tolist():
        stop = start + int(counts[h])
        parts.append(code(low[order[start:stop]], plane_alphabet(alphabet, h)))
        start = stop
    head = HEADER.pack(VERSION, bytes(3), alphabet, symbols.size)
    return head + b"".join(part(p) for p in parts)


def decode(data: bytes | memoryview, max_symbols: int | None, decode_plane: PlaneDecoder):
    """The symbols (uint32) of a version-2 stream; ``decode_plane`` decodes one version-1
    plane stream of a known count. Every inconsistency is a `CorruptStreamError`."""
    reader = StreamReader(data, "entropy")
    version, reserved, alphabet, n = reader.unpack(HEADER.format)
    if version != VERSION or reserved != bytes(3) or not PLANE < alphabet <= MAX_ALPHABET:
        raise CorruptStreamError(
            f"entropy stream version {version} header is inconsistent: alphabet {alphabet}"
        )
    if max_symbols is not None and n > max_symbols:
        raise CorruptStreamError(
            f"entropy stream claims {n} symbols, more than the {max_symbols} expected"
        )
    blocks = -(-alphabet // PLANE)
    high = _plane(reader.part(), n, blocks, decode_plane, "high").astype(np.int64)
    counts = np.bincount(high, minlength=blocks)
    order = np.argsort(high, kind="stable")
    out = np.empty(n, dtype=np.uint32)
    start = 0
    for h in np.flatnonzero(counts).tolist():
        stop = start + int(counts[h])
        low = _plane(reader.part(), stop - start, plane_alphabet(alphabet, h), decode_plane, h)
        out[order[start:stop]] = (h << PLANE_BITS) | low.astype(np.uint32)
        start = stop
    reader.finish()
    return out


def _plane(
    data: memoryview, count: int, alphabet: int, decode_plane: PlaneDecoder, which
) -> np.ndarray:
    """One plane: a version-1 stream of exactly ``count`` symbols over exactly ``alphabet``
    (what the writer writes; anything else is damage)."""
    header = stream.HEADER.unpack_from(data) if len(data) >= stream.HEADER.size else None
    if header is None or header[0] != stream.VERSION or header[4] != alphabet:
        raise CorruptStreamError(
            f"entropy stream plane {which} is not a version-1 stream over {alphabet} symbols"
        )
    symbols = decode_plane(data, count)
    if symbols.size != count:
        raise CorruptStreamError(
            f"entropy stream plane {which} holds {symbols.size} symbols, not {count}"
        )
    return symbols
