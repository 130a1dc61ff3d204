"""Bare token streams for trie nodes: one range-coder stream, no header of its own.

A trie archive stores thousands of short branches; the self-describing token stream
(token_coder.py, 32+ bytes of header and chunk table) would cost more than a 200-token branch
under a good model. Here the container's node table holds what the header held — token count,
payload length and a 16-bit token checksum — so a node costs its range-coded bytes plus the
flush byte. Rows of frequencies come from the caller: the model state at the node's branch
point, which the codec library knows nothing about.
"""

from __future__ import annotations

import zlib

import numpy as np

from seqkv_codecs.errors import CorruptStreamError
from seqkv_codecs.sequential.probability import find_symbol
from seqkv_codecs.sequential.rangecoder import RangeDecoder, RangeEncoder


def token_check(tokens: np.ndarray) -> int:
    """16-bit checksum of token ids: catches a decoder whose model or numerics differ."""
    return zlib.crc32(np.asarray(tokens, dtype="<u4").tobytes()) & 0xFFFF


def intervals(freqs: np.ndarray, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(cum_low, freq) of each token under its row of ``freqs`` (rows x V)."""
    ids = np.asarray(tokens, dtype=np.int64)[:, None]
    low = np.where(np.arange(freqs.shape[-1])[None, :] < ids, freqs, 0).sum(axis=1)
    return low, np.take_along_axis(freqs, ids, axis=1)[:, 0]


def encode_node(low: np.ndarray, freq: np.ndarray, precision_bits: int) -> bytes:
    """One range-coder stream of the given intervals (one per token)."""
    enc = RangeEncoder()
    for c, f in zip(np.asarray(low).tolist(), np.asarray(freq).tolist(), strict=True):
        enc.encode(c, f, precision_bits)
    return enc.finish()


class NodeDecoder:
    """Decodes one node's tokens one row at a time; ``close`` checks length and checksum."""

    def __init__(
        self,
        data: bytes,
        n_tokens: int,
        check: int,
        precision_bits: int,
        max_tokens: int | None = None,
    ) -> None:
        # n_tokens comes from the archive's node table: it sizes the output, so bound it first
        if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or n_tokens < 0:
            raise CorruptStreamError(f"a trie node claims {n_tokens!r} tokens")
        if max_tokens is not None and n_tokens > max_tokens:
            raise CorruptStreamError(
                f"a trie node claims {n_tokens} tokens, more than the {max_tokens} allowed"
            )
        if not isinstance(precision_bits, int) or not 1 <= precision_bits <= 31:
            raise CorruptStreamError(
                f"precision_bits must be an integer in 1..31, not {precision_bits!r}"
            )
        self.n, self.check, self.precision = n_tokens, check, precision_bits
        self.out = np.zeros(n_tokens, dtype=np.int64)
        self.pos = 0
        self._dec = RangeDecoder(data) if n_tokens else None
        if not n_tokens and data:
            raise CorruptStreamError("an empty trie node carries payload bytes")

    @property
    def done(self) -> bool:
        return self.pos >= self.n

    def step(self, row: np.ndarray) -> int:
        """Decode the next token under frequency ``row``; returns it."""
        symbol, low = find_symbol(row, self._dec.peek(self.precision))
        self._dec.advance(low, int(row[symbol]), self.precision)
        self.out[self.pos] = symbol
        self.pos += 1
        return symbol

    def close(self) -> np.ndarray:
        if self._dec is not None:
            self._dec.finish_check()
        if token_check(self.out) != self.check:
            raise CorruptStreamError(
                "trie node tokens fail their checksum: the decoder's model or numerics differ "
                "from the encoder's, or the archive is damaged"
            )
        return self.out


def verify_node(data: bytes, low: np.ndarray, freq: np.ndarray, precision_bits: int) -> None:
    """Check that `data` decodes to exactly these intervals (an encoder self-check)."""
    dec = RangeDecoder(data)
    for c, f in zip(np.asarray(low).tolist(), np.asarray(freq).tolist(), strict=True):
        if not c <= dec.peek(precision_bits) < c + f:
            raise CorruptStreamError("a freshly coded trie node does not decode to its tokens")
        dec.advance(c, f, precision_bits)
    dec.finish_check()
