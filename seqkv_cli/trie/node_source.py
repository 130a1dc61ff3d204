"""Reading a trie node's stored part on demand: its payload bytes (`seq`) or its token ids
(`seq-fast`, per-vector), checked against the node's own record before they are used."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from seqkv_cli.errors import SeqkvError
from seqkv_cli.trie.store import TrieContents


class NodeSource:
    """Payload bytes (seq) or token ids (seq-fast, per-vector) of nodes, read on demand."""

    def __init__(
        self,
        contents: TrieContents,
        read_part: Callable[[int, str], bytes],
        vocab_size: int,
        precision: int,
    ) -> None:
        check_precision(precision)
        self.contents, self.read_part, self.vocab = contents, read_part, vocab_size
        self.precision = precision
        self._tokens: dict[int, np.ndarray] = {}

    def payload(self, n: int) -> bytes:
        node = self.contents.nodes[n]
        data = self.read_part(node.segment, "tokens")
        return data[node.payload_offset : node.payload_offset + node.payload]

    def tokens(self, n: int) -> np.ndarray:
        from seqkv_codecs.entropy import decode_symbols
        from seqkv_codecs.errors import CodecError
        from seqkv_codecs.packed_ids import is_packed, unpack_ids
        from seqkv_codecs.sequential.node_stream import token_check

        node = self.contents.nodes[n]
        if node.segment not in self._tokens:
            # The total is the nodes' own claim, bounded by store.load_trie (each node by the
            # context, the segment by MAX_SEGMENT_TOKENS): the stream may not hold more.
            total = sum(x.n_tokens for x in self.contents.nodes if x.segment == node.segment)
            try:
                data = self.read_part(node.segment, "tokens")
                if is_packed(data):  # format 1.7: a short segment's ids at a fixed width
                    ids = unpack_ids(data, total)
                else:
                    ids = decode_symbols(data, max_symbols=total) if data else np.zeros(0, int)
            except (CodecError, ValueError) as exc:
                raise SeqkvError(f"segment {node.segment} token stream: {exc}") from None
            if len(ids) != total or (len(ids) and int(ids.max()) >= self.vocab):
                raise SeqkvError(f"segment {node.segment} token stream has the wrong length")
            self._tokens[node.segment] = ids.astype(np.int64)
        ids = self._tokens[node.segment][node.token_offset : node.token_offset + node.n_tokens]
        if token_check(ids) != node.check:
            raise SeqkvError(f"node {n}: tokens fail their checksum (damaged archive)")
        return ids


def check_precision(precision: object) -> None:
    """A codec config read from the file: a non-integer precision would fail deep inside."""
    if isinstance(precision, bool) or not isinstance(precision, int) or not 1 <= precision <= 31:
        raise SeqkvError(
            f"the codec's precision_bits must be an integer in 1..31, not {precision!r}"
        )
