"""Entropy-coded symbol sections shared by the per-vector codecs.

A symbol section is a `seqkv_codecs.framing.part` (uint32 length + bytes) holding one
`seqkv_codecs.entropy.encode_symbols` stream. The decoder knows how many symbols and which
alphabet to expect from the codec's own layout, and checks both, so a stream that decodes
"successfully" into the wrong number of symbols is still reported as corrupt.
"""

from __future__ import annotations

import numpy as np

from seqkv_codecs.errors import CorruptStreamError
from seqkv_codecs.framing import StreamReader, part


def lanes_for(n: int) -> int:
    """rANS lanes for ``n`` symbols: one per 1024 (0.03 bits of lane state per symbol).

    Fixed here rather than left to the entropy module's default, so that retuning that default
    for speed cannot silently change (or grow) these codecs' streams.
    """
    return max(1, n // 1024, -(-n // 65536))


def pack_symbols(symbols: np.ndarray, alphabet_size: int) -> bytes:
    """One framed rANS stream of ``symbols`` (ints in ``[0, alphabet_size)``)."""
    from seqkv_codecs.entropy import encode_symbols  # lazy: keeps `import seqkv_codecs` light

    flat = np.ascontiguousarray(symbols).reshape(-1)
    # "auto": the GPU for long streams when one is selected (entropy.placement); same bytes
    return part(encode_symbols(flat, alphabet_size, lanes=lanes_for(flat.size), backend="auto"))


def unpack_symbols(
    reader: StreamReader,
    count: int | None,
    alphabet_size: int,
    what: str,
    max_count: int | None = None,
) -> np.ndarray:
    """Read a section written by `pack_symbols`: exactly ``count`` symbols (or at most
    ``max_count`` when the count is not known in advance), all below ``alphabet_size``."""
    from seqkv_codecs.entropy import decode_symbols

    payload = reader.part()
    try:
        limit = count if count is not None else max_count
        symbols = decode_symbols(payload, max_symbols=limit, backend="auto")
    except CorruptStreamError:
        raise
    except (ValueError, TypeError, IndexError, OverflowError) as exc:
        raise CorruptStreamError(f"{what}: entropy-coded section is corrupt ({exc})") from exc
    if count is not None and symbols.size != count:
        raise CorruptStreamError(f"{what}: expected {count} symbols, found {symbols.size}")
    if symbols.size and int(symbols.max()) >= alphabet_size:
        raise CorruptStreamError(f"{what}: symbol outside the alphabet of {alphabet_size}")
    return symbols
