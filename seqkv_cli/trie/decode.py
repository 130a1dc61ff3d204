"""Restoring sessions from a trie archive, decoding only the nodes on their paths.

Nodes are decoded parent first; each starts from a fork of its parent's state at its branch
point. `seq` nodes step the model once per token, several nodes in lockstep as rows of one
pass; `seq-fast` nodes are one prefill each. A node is released once its children have
started and its sessions are out, so memory holds the current frontier, not the archive.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from seqkv_cli.errors import SeqkvError
from seqkv_cli.kvcapture.capture_file import DTYPES
from seqkv_cli.sequential.adapter import CanonicalLogits
from seqkv_cli.sequential.registry import capabilities
from seqkv_cli.sequential.session_codec import finish_capture
from seqkv_cli.trie.runs import Run, prefill, session_kv, start_run
from seqkv_cli.trie.store import TrieContents, chain

LOCKSTEP = 16  # seq nodes stepped together (memory: one K/V state each)


class NodeSource:
    """Payload bytes (seq) or token ids (seq-fast, per-vector) of nodes, read on demand."""

    def __init__(self, contents: TrieContents, read_part, vocab_size: int, precision: int) -> None:
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
        from seqkv_codecs.sequential.node_stream import token_check

        node = self.contents.nodes[n]
        if node.segment not in self._tokens:
            # The total is the nodes' own claim, bounded by store.load (each node by the
            # context, the segment by MAX_SEGMENT_TOKENS): the stream may not hold more.
            total = sum(x.n_tokens for x in self.contents.nodes if x.segment == node.segment)
            try:
                data = self.read_part(node.segment, "tokens")
                ids = decode_symbols(data, max_symbols=total) if data else np.zeros(0, np.int64)
            except (CodecError, ValueError) as exc:
                raise SeqkvError(f"segment {node.segment} token stream: {exc}") from None
            if len(ids) != total or (len(ids) and int(ids.max()) >= self.vocab):
                raise SeqkvError(f"segment {node.segment} token stream has the wrong length")
            self._tokens[node.segment] = ids.astype(np.int64)
        ids = self._tokens[node.segment][node.token_offset : node.token_offset + node.n_tokens]
        if token_check(ids) != node.check:
            raise SeqkvError(f"node {n}: tokens fail their checksum (damaged archive)")
        return ids


def check_precision(precision) -> None:
    """A codec config read from the file: a non-integer precision would fail deep inside."""
    if isinstance(precision, bool) or not isinstance(precision, int) or not 1 <= precision <= 31:
        raise SeqkvError(
            f"the codec's precision_bits must be an integer in 1..31, not {precision!r}"
        )


def restore(
    contents: TrieContents, wanted: list[int], source: NodeSource, codec, canon, entries, reads
) -> Iterator[tuple[int, object]]:
    """Yield (session index, Capture or the SeqkvError that stopped it) as sessions finish."""
    nodes = contents.nodes
    needed = sorted({n for s in wanted for n in chain(nodes, contents.sessions[s].end_node)})
    kids: dict[int, list[int]] = {}
    for n in needed:
        kids.setdefault(nodes[n].parent, []).append(n)
    ending: dict[int, list[int]] = {}
    for s in wanted:
        ending.setdefault(contents.sessions[s].end_node, []).append(s)
    # Decode a node only as far as its sessions and children reach: its tail may belong to
    # sessions nobody asked for. A node decoded to its end is also checked (token_check).
    limit = {
        n: max(
            [contents.sessions[s].end for s in ending.get(n, [])]
            + [nodes[c].attach for c in kids.get(n, [])]
        )
        for n in needed
    }
    adapter = CanonicalLogits(canon)
    alive: dict[int, Run | Exception] = {}
    pending_kids = {n: len(kids.get(n, [])) for n in needed}
    ready = list(kids.get(-1, []))
    stepping = capabilities(codec).steps_model
    while ready:
        batch, ready = (ready[:LOCKSTEP], ready[LOCKSTEP:]) if stepping else (ready[:1], ready[1:])
        runs = []
        for n in batch:
            parent = nodes[n].parent
            try:
                run = _start(adapter, alive.get(parent), n, nodes, source, stepping, limit[n])
                run.want_rows = {nodes[c].attach for c in kids.get(n, [])}
                runs.append(run)
            except SeqkvError as exc:
                runs.append(exc)
            if parent >= 0:
                pending_kids[parent] -= 1
                if pending_kids[parent] == 0:
                    alive.pop(parent, None)
        live = [r for r in runs if isinstance(r, Run)]
        errors = _step_all(adapter, live, source) if stepping else _prefill_all(adapter, live)
        for n, run in zip(batch, runs, strict=True):
            done = errors.get(n, run)
            for s in ending.get(n, []):
                yield s, _session(done, contents, s, entries[s], reads[s], canon)
            if pending_kids[n]:
                alive[n] = done
            ready += kids.get(n, [])
        adapter.tracks.clear()


def _start(adapter, parent, n, nodes, source: NodeSource, stepping: bool, limit: int) -> Run:
    node = nodes[n]
    if isinstance(parent, Exception):
        raise SeqkvError(f"its prefix could not be decoded: {parent}")
    tokens = None if stepping else source.tokens(n)
    return start_run(adapter, parent, n, node.start, node.attach, limit, tokens)


def _prefill_all(adapter, runs: list[Run]) -> dict:
    for run in runs:
        prefill(adapter, run)
    return {}


def _step_all(adapter: CanonicalLogits, runs: list[Run], source: NodeSource) -> dict:
    """Decode the runs' tokens in lockstep; returns {node: error} for the runs that failed."""
    from seqkv_codecs.errors import CodecError
    from seqkv_codecs.sequential.node_stream import NodeDecoder
    from seqkv_codecs.sequential.probability import frequencies_from_logits
    from seqkv_codecs.sequential.token_coder import uniform_row

    errors: dict[int, Exception] = {}
    precision = source.precision
    decs, rows = {}, {}
    for run in runs:
        node = source.contents.nodes[run.node]
        try:
            decs[run.node] = NodeDecoder(
                source.payload(run.node),
                node.n_tokens,
                node.check,
                precision,
                max_tokens=adapter.canon.max_context,
            )
        except CodecError as exc:
            errors[run.node] = SeqkvError(f"node {run.node}: {exc}")
            continue
        rows[run.node] = (
            uniform_row(adapter.vocab_size, precision)
            if run.first_row is None
            else frequencies_from_logits(run.first_row.numpy(), precision)
        )
        run.tokens = decs[run.node].out
    live = [r for r in runs if r.node in decs]
    while live:
        fed = []
        for run in live:
            try:
                decs[run.node].step(rows[run.node])
                fed.append(run)
            except CodecError as exc:
                errors[run.node] = SeqkvError(f"node {run.node} does not decode: {exc}")
        if not fed:
            break
        ids = np.array([decs[r.node].out[decs[r.node].pos - 1] for r in fed], dtype=np.int64)
        logits = adapter.feed_rows([r.track for r in fed], ids)
        freqs = frequencies_from_logits(logits, precision)
        live = []
        for i, run in enumerate(fed):
            dec = decs[run.node]
            run.keep_row(dec.pos, torch.from_numpy(logits[i].copy()))
            rows[run.node] = freqs[i]
            if dec.pos < run.n_tokens:
                live.append(run)
                continue
            if not dec.done:
                continue  # stopped early: the rest of the node is not needed
            try:
                dec.close()
            except CodecError as exc:
                errors[run.node] = SeqkvError(f"node {run.node}: {exc}")
    return errors


def _session(run, contents: TrieContents, s: int, entry: dict, read, canon):
    if isinstance(run, Exception):
        return SeqkvError(f"session {entry['id']}: {run}")
    rec = contents.sessions[s]
    try:
        keys, values, surprisal = session_kv(run, rec.end, DTYPES[entry["dtype"]], canon.num_layers)
        return finish_capture(entry, read, run.all_tokens(rec.end), keys, values, surprisal)
    except SeqkvError as exc:
        return exc
