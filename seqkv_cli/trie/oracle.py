"""Finding a new session's place in an archived `seq` trie without stepping the model.

Archived `seq` nodes are range-coded, so their tokens are unknown until decoded — and
decoding steps the model once per token. But the new session's own prefill gives the rows a
decoder would use *as long as the session agrees with the node so far*: decode each node
symbol under the session's row for that position, compare, stop at the first difference.
The whole search costs one prefill of the new session (which encoding it needs anyway).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from seqkv_cli.errors import SeqkvError
from seqkv_cli.sequential.adapter import CanonicalLogits
from seqkv_cli.trie.plan import Trie
from seqkv_cli.trie.runs import PREFILL_CHUNK

if TYPE_CHECKING:
    from seqkv_cli.trie.node_source import NodeSource


class RowStream:
    """Logits predicting each position of one sequence, produced chunk by chunk, in order."""

    def __init__(self, adapter: CanonicalLogits, tokens: np.ndarray) -> None:
        self.adapter, self.tokens = adapter, tokens
        self.track = adapter.start(len(tokens))
        self.first, self.logits = 1, np.zeros((0, adapter.vocab_size), np.float32)

    def row(self, p: int) -> np.ndarray | None:
        """Logits predicting position `p` (None for position 0: the uniform row)."""
        if p == 0:
            return None
        while p >= self.first + len(self.logits):
            self._advance()
        if p < self.first:
            raise SeqkvError("internal: rows are read in position order")
        return self.logits[p - self.first]

    def rows_from(self, p: int) -> np.ndarray:
        """All rows of the current chunk from position `p` on (at least one)."""
        self.row(p)
        return self.logits[p - self.first :]

    def _advance(self) -> None:
        s = self.track.fed
        if s >= len(self.tokens):
            raise SeqkvError("internal: no rows beyond the end of the sequence")
        chunk = self.tokens[s : s + PREFILL_CHUNK]
        ids = torch.from_numpy(np.asarray(chunk, dtype=np.int64))
        logits = self.adapter.canon.forward(self.track.state, ids)
        self.track.record(ids, logits)
        self.first, self.logits = s + 1, logits.numpy()

    def finish(self):
        while self.track.fed < len(self.tokens):
            self._advance()
        return self.track


class NodeOracle:
    """Tokens of archived nodes, learnt by decoding them under new sessions' rows."""

    def __init__(self, source: NodeSource, precision: int) -> None:
        self.source, self.precision = source, precision
        self.decoders: dict[int, object] = {}

    def token(self, node: int, k: int, rows: RowStream, p: int) -> int:
        from seqkv_codecs.errors import CodecError
        from seqkv_codecs.sequential.node_stream import NodeDecoder

        dec = self.decoders.get(node)
        if dec is None:
            meta = self.source.contents.nodes[node]
            try:
                dec = NodeDecoder(
                    self.source.payload(node), meta.n_tokens, meta.check, self.precision
                )
            except CodecError as exc:
                raise SeqkvError(f"archived node {node} is damaged: {exc}") from None
            self.decoders[node] = dec
        if k < dec.pos:
            return int(dec.out[k])
        try:
            token = dec.step(self._freqs(rows.row(p)))
            if dec.done:
                dec.close()
        except CodecError as exc:
            raise SeqkvError(f"archived node {node} does not decode: {exc}") from None
        return token

    def _freqs(self, logits: np.ndarray | None) -> np.ndarray:
        from seqkv_codecs.sequential.probability import frequencies_from_logits
        from seqkv_codecs.sequential.token_coder import uniform_row

        if logits is None:
            return uniform_row(self.source.vocab, self.precision)
        return frequencies_from_logits(logits, self.precision)


def match(trie: Trie, tokens: np.ndarray, oracle: NodeOracle, rows: RowStream):
    """(node, tokens of it matched, total matched): the deepest path `tokens` follows.

    All candidates sit at the same position, so rows are produced once, in order.
    """
    at: dict[int, dict[int, list[int]]] = {}
    for n, node in enumerate(trie.nodes):
        at.setdefault(node.parent, {}).setdefault(node.attach, []).append(n)
    cands = [(r, 0) for r in at.get(-1, {}).get(0, [])]
    best, p = (-1, 0, 0), 0
    while cands and p < len(tokens):
        following = []
        for n, k in cands:
            node = trie.nodes[n]
            got = int(node.tokens[k]) if node.tokens is not None else oracle.token(n, k, rows, p)
            if got != tokens[p]:
                continue
            k += 1
            if p + 1 > best[2]:
                best = (n, k, p + 1)
            if k < node.length:
                following.append((n, k))
            following += [(c, 0) for c in at.get(n, {}).get(k, [])]
        cands, p = following, p + 1
    return best
