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
from seqkv_cli.sequential.adapter import CanonicalLogits, Track
from seqkv_cli.trie.plan import Trie
from seqkv_cli.trie.runs import PREFILL_CHUNK, fork_track

if TYPE_CHECKING:
    from seqkv_cli.runtime.forward import CanonicalForward
    from seqkv_cli.trie.node_source import NodeSource


class WarmStates:
    """The canonical state of the session this process appended last, for the append that
    extends it (an agent's next turn). That append forks it and runs only its new tokens,
    where it would prefill the whole session again: the forward gives the same bits however
    a sequence is cut (docs/NUMERICS.md). It holds one session's K/V while kept."""

    def __init__(self) -> None:
        self._last: tuple[str, np.ndarray, Track, object] | None = None

    def keep(
        self, session_id: str, tokens: np.ndarray, track: Track, canon: CanonicalForward
    ) -> None:
        self._last = (session_id, np.array(tokens, np.int64), track, canon)

    def clear(self) -> None:
        self._last = None

    def take(self, tokens: np.ndarray, canon: CanonicalForward) -> tuple[str, Track] | None:
        """(session id, its state) where that session's tokens begin `tokens` and `canon`
        computed it, else None."""
        if self._last is None:
            return None
        sid, held, track, forward = self._last
        m = len(held)
        if forward is not canon or not 0 < m <= len(tokens) or track.last_row is None:
            return None
        return (sid, track) if np.array_equal(tokens[:m], held) else None


class RowStream:
    """Logits predicting each position of one sequence, produced chunk by chunk, in order."""

    def __init__(
        self, adapter: CanonicalLogits, tokens: np.ndarray, warm: Track | None = None
    ) -> None:
        """Rows of `tokens` from the start, or from where `warm` (a state that fed their
        first positions) ends: it is forked, and rows before it are never asked for."""
        self.adapter, self.tokens = adapter, tokens
        self.first, self.logits = 1, np.zeros((0, adapter.vocab_size), np.float32)
        if warm is None:
            self.track = adapter.start(len(tokens))
        else:
            self.track = fork_track(adapter, warm, warm.fed, len(tokens), warm.last_row)
            self.first, self.logits = warm.fed, warm.last_row[None].numpy()

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


def match(
    trie: Trie,
    tokens: np.ndarray,
    oracle: NodeOracle,
    rows: RowStream,
    start: tuple[int, int, int] | None = None,
):
    """(node, tokens of it matched, total matched): the deepest path `tokens` follows.

    All candidates sit at the same position, so rows are produced once, in order. `start`
    = (node, tokens of it, position): where a known prefix of `tokens` already ends (an
    archived session a warm RowStream continues); the search goes on from there. A node
    coded under the model is only followed from its first token (its stream decodes in
    order), so inside one the search stops where the prefix ends.
    """
    at: dict[int, dict[int, list[int]]] = {}
    for n, node in enumerate(trie.nodes):
        at.setdefault(node.parent, {}).setdefault(node.attach, []).append(n)
    cands = [(r, 0) for r in at.get(-1, {}).get(0, [])]
    best, p = (-1, 0, 0), 0
    if start is not None:
        n, k, p = start
        best = (n, k, p)
        inside = k < trie.nodes[n].length and trie.nodes[n].tokens is not None
        cands = ([(n, k)] if inside else []) + [(c, 0) for c in at.get(n, {}).get(k, [])]
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
