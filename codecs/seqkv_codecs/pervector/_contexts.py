"""Context-split symbol streams: one static rANS stream per context, consumed as queues.

The entropy coder has one static table per stream, so a context model is realised by routing
each symbol to the stream of its context. When the context of a token depends on the previous
token (already decoded), the decoder decodes every stream up front and then walks the tokens
in order, taking each symbol from the front of its context's queue. The encoder therefore
appends symbols in exactly that order: token by token, and within a token in (head, channel)
order.
"""

from __future__ import annotations

import numpy as np

from seqkv_codecs.errors import CorruptStreamError
from seqkv_codecs.framing import StreamReader
from seqkv_codecs.pervector._symbols import pack_symbols, unpack_symbols


def pack_by_context(
    symbols: np.ndarray, contexts: np.ndarray, n_contexts: int, alphabet_size: int
) -> bytes:
    """``n_contexts`` sections; section k holds ``symbols[contexts == k]`` in array order."""
    symbols, contexts = symbols.reshape(-1), contexts.reshape(-1)
    return b"".join(pack_symbols(symbols[contexts == k], alphabet_size) for k in range(n_contexts))


class ContextQueues:
    """The decoded streams of `pack_by_context`, handed out in encoding order."""

    def __init__(
        self, reader: StreamReader, n_contexts: int, total: int, alphabet_size: int, what: str
    ) -> None:
        self._what = what
        self._queues = [
            unpack_symbols(reader, None, alphabet_size, what, max_count=total).astype(np.int64)
            for _ in range(n_contexts)
        ]
        if sum(q.size for q in self._queues) != total:
            raise CorruptStreamError(f"{what}: context streams do not hold {total} symbols")
        self._sizes = np.array([q.size for q in self._queues], dtype=np.int64)
        self._start = np.cumsum(self._sizes) - self._sizes
        self._flat = np.concatenate([*self._queues, np.zeros(1, np.int64)])
        self._next = np.zeros(n_contexts, dtype=np.int64)

    def take(self, contexts: np.ndarray) -> np.ndarray:
        """The next symbol of each element's context; elements of one context in array order."""
        onehot = contexts[:, None] == np.arange(self._next.size)
        rank = np.cumsum(onehot, axis=0)[np.arange(contexts.size), contexts] - 1
        pos = self._start[contexts] + self._next[contexts] + rank
        self._next += onehot.sum(axis=0)
        if np.any(self._next > self._sizes):
            raise CorruptStreamError(f"{self._what}: a context stream ran out of symbols")
        return self._flat[pos]
