"""Restoring sessions from a trie archive, decoding only the nodes on their paths.

Nodes are decoded parent first; each starts from a fork of its parent's state at its branch
point. `seq` nodes step the model once per token, several nodes in lockstep as rows of one
pass; `seq-fast` nodes are one prefill each. A node is released once its children have
started and its sessions are out, so memory holds the current frontier, not the archive.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from seqkv_cli.errors import SeqkvError
from seqkv_cli.kvcapture.capture_file import DTYPES
from seqkv_cli.sequential.adapter import CanonicalLogits, drafts_enabled, unrounded_kv
from seqkv_cli.sequential.registry import capabilities
from seqkv_cli.sequential.session_codec import finish_capture
from seqkv_cli.trie.runs import Run, prefill, session_kv, start_run
from seqkv_cli.trie.store import TrieContents, chain

LOCKSTEP = 16  # seq nodes stepped together (memory: one K/V state each)


@dataclass
class DecodeStats:
    """What a `seq` restore cost: model passes, node rows over all passes (a node stepped
    in a pass is one), tokens decoded, guesses fed and right."""

    passes: int = 0
    node_steps: int = 0
    tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    total: int = 0  # tokens this restore decodes (shared prefixes once)
    on_tokens: Callable[[int, int], None] | None = None  # (tokens so far, total): progress

    def report(self) -> None:
        if self.on_tokens is not None:
            self.on_tokens(self.tokens, self.total)

    @property
    def tokens_per_step(self) -> float:
        """tau: tokens a node gets from one pass (1.0 without guesses)."""
        return self.tokens / self.node_steps if self.node_steps else 0.0


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
    contents: TrieContents,
    wanted: list[int],
    source: NodeSource,
    codec,
    canon,
    entries,
    reads,
    stats: DecodeStats | None = None,
) -> Iterator[tuple[int, object]]:
    """Yield (session index, Capture or the SeqkvError that stopped it) as sessions finish;
    `stats`, if given, is filled with what the `seq` decoding cost."""
    kids, ending, limit = _needed(contents, wanted)
    nodes = contents.nodes
    stats = stats if stats is not None else DecodeStats()
    stats.total += sum(limit.values())
    plan = _Plan(CanonicalLogits(canon), nodes, kids, limit, source, stats)
    stepping = capabilities(codec).steps_model
    for n, done in plan.stepped() if stepping else plan.prefilled():
        for s in ending.get(n, []):
            yield s, _session(done, contents, s, entries[s], reads[s], canon)


def _needed(contents: TrieContents, wanted: list[int]):
    """For restoring `wanted`: the needed nodes' children ({parent: [node]}, roots under -1),
    the sessions ending in each node, and how far each node must be decoded."""
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
    return kids, ending, limit


def planned_passes(contents: TrieContents, wanted: list[int]) -> tuple[int, int]:
    """(model passes, tokens) a `seq` restore of `wanted` needs without guesses: `stepped`'s
    schedule replayed on node lengths alone (LOCKSTEP rows, a child ready once its parent
    has passed its branch point, ready nodes in order), for estimates (skv.restore_time)."""
    kids, _, limit = _needed(contents, wanted)
    nodes = contents.nodes
    ready, active, passes = deque(kids.get(-1, [])), {}, 0
    while ready or active:
        while ready and len(active) < LOCKSTEP:
            n = ready.popleft()
            active[n] = 0
        # every active node gains one token a pass: jump to the next start or end
        events = [limit[n] - done for n, done in active.items()]
        events += [
            nodes[c].attach - done
            for n, done in active.items()
            for c in kids.get(n, [])
            if nodes[c].attach > done
        ]
        step = max(1, min(events)) if events else 1
        passes += step if active else 0
        for n in list(active):
            before, active[n] = active[n], min(active[n] + step, limit[n])
            ready.extend(c for c in kids.get(n, []) if before < nodes[c].attach <= active[n])
            ready.extend(c for c in kids.get(n, []) if nodes[c].attach == 0 and before == 0)
            if active[n] >= limit[n]:
                del active[n]
    return passes, sum(limit.values())


class _Plan:
    """Which nodes run when, and when their results are final.

    A child needs only its parent's state at its branch point: with `seq` it starts as soon
    as the parent's decoder passes that point (nodes are never split, so most children branch
    off inside their parent), taking a free row at the next model pass. A result is final
    once every ancestor has passed its own end checks: a child that finishes first waits, and
    one whose ancestor fails fails with it (its prefix was decoded from a damaged stream).
    """

    def __init__(self, adapter, nodes, kids, limit, source: NodeSource, stats=None) -> None:
        self.adapter, self.nodes, self.kids, self.limit = adapter, nodes, kids, limit
        self.source = source
        self.stats = stats if stats is not None else DecodeStats()
        self.alive: dict[int, Run | Exception] = {}  # states children still fork from
        self.pending_kids = {n: len(kids.get(n, [])) for n in limit}
        self.queued: set[int] = set()
        self.ready: deque[int] = deque()
        self.finished: dict[int, Run | Exception] = {}  # done, an ancestor not yet settled
        self.settled: dict[int, Run | Exception] = {}
        self._queue(kids.get(-1, []))

    def _queue(self, nodes) -> None:
        for n in nodes:
            if n not in self.queued:
                self.queued.add(n)
                self.ready.append(n)

    def start(self, n: int, stepping: bool) -> Run | Exception:
        """The node's run, forked from its parent (whose state is dropped after its last
        child has forked and it is settled), or the error that prevents it."""
        parent = self.nodes[n].parent
        try:
            run = _start(
                self.adapter, self.alive.get(parent), n, self.nodes, self.source, stepping,
                self.limit[n],
            )  # fmt: skip
            run.want_rows = {self.nodes[c].attach for c in self.kids.get(n, [])}
        except SeqkvError as exc:
            run = exc
        if parent >= 0:
            self.pending_kids[parent] -= 1
            if self.pending_kids[parent] == 0 and parent in self.settled:
                self.alive.pop(parent, None)
        if self.pending_kids[n]:
            self.alive[n] = run
        return run

    def passed(self, n: int, offset: int) -> None:
        """Node `n` has decoded `offset` tokens: children branching there can start."""
        self._queue(c for c in self.kids.get(n, []) if self.nodes[c].attach == offset)

    def finish(self, n: int, done: Run | Exception) -> list[tuple[int, Run | Exception]]:
        """Record a node's result; return the results this makes final, parents first."""
        if self.pending_kids[n]:
            self.alive[n] = done
        self._queue(self.kids.get(n, []))  # children the node never reached start (and fail)
        self.finished[n] = done
        parent = self.nodes[n].parent
        if parent >= 0 and parent not in self.settled:
            return []  # final once its parent is
        out, todo = [], [n]
        while todo:
            m = todo.pop()
            result = self.finished.pop(m)
            up = self.nodes[m].parent
            if up >= 0 and isinstance(self.settled[up], Exception):
                result = SeqkvError(f"its prefix could not be decoded: {self.settled[up]}")
            self.settled[m] = result
            if self.pending_kids[m] == 0:
                self.alive.pop(m, None)
            else:
                self.alive[m] = result
            out.append((m, result))
            todo.extend(c for c in self.kids.get(m, []) if c in self.finished)
        return out

    def prefilled(self) -> Iterator[tuple[int, Run | Exception]]:
        """seq-fast: each node is one prefill of its known tokens."""
        while self.ready:
            n = self.ready.popleft()
            run = self.start(n, stepping=False)
            if isinstance(run, Run):
                prefill(self.adapter, run)
                self.stats.tokens += run.n_tokens
                self.stats.report()
            self.adapter.tracks.clear()
            yield from self.finish(n, run)

    def stepped(self) -> Iterator[tuple[int, Run | Exception]]:
        """seq: every running node steps once per model pass, as one row of it; a node that
        becomes ready takes a free row at the next pass (continuous batching). A node's row
        carries guesses of its next tokens when the decoded text suggests some (drafts.py):
        each right guess is a token decoded in the same pass."""
        from seqkv_codecs.sequential.drafts import MAX_DRAFT, ROW_BUDGET, DraftIndex

        drafter = DraftIndex() if drafts_enabled() else None
        active: dict[int, _Stepper] = {}
        while self.ready or active:
            while self.ready and len(active) < LOCKSTEP:
                n = self.ready.popleft()
                run = self.start(n, stepping=True)
                stepper = _Stepper.begin(run, self.adapter, self.source, drafter)
                if isinstance(stepper, Exception):
                    yield from self.finish(n, stepper)
                else:
                    active[n] = stepper
            self.adapter.tracks.clear()  # the runs hold their tracks; nothing else should
            fed = []
            for n, stepper in list(active.items()):
                error = stepper.step()
                if error is None:
                    fed.append(stepper)
                else:
                    del active[n]
                    yield from self.finish(n, error)
            if not fed:
                continue
            limit = min(MAX_DRAFT, ROW_BUDGET // len(fed) - 1) if drafter else 0
            guesses = [f.guess(limit) for f in fed] if limit > 0 else [([], 0)] * len(fed)
            self.stats.passes += 1
            self.stats.node_steps += len(fed)
            if not any(g for g, _ in guesses):
                done = self._single_rows(fed)
            else:
                done = self._draft_rows(fed, guesses, drafter)
            self.stats.report()
            for n, result in done:
                del active[n]
                yield from self.finish(n, result)

    def _single_rows(self, fed: list[_Stepper]) -> list:
        """One token per node: the pass of a decoder without guesses."""
        from seqkv_codecs.sequential.probability import frequencies_from_logits

        ids = np.array([f.last_token for f in fed], dtype=np.int64)
        logits = self.adapter.feed_rows([f.run.track for f in fed], ids)
        freqs = frequencies_from_logits(logits, self.source.precision)
        done = []
        for i, stepper in enumerate(fed):
            self.stats.tokens += 1
            result = stepper.took(logits[i], freqs[i])
            self.passed(stepper.run.node, stepper.decoder.pos)
            if result is not None:
                done.append((stepper.run.node, result))
        return done

    def _draft_rows(self, fed: list[_Stepper], guesses: list, drafter) -> list:
        """Each node's last token and its guesses in one pass; keep what the stream confirms."""
        lists = [[f.last_token, *g] for f, (g, _) in zip(fed, guesses, strict=True)]
        outs = self.adapter.feed_drafts([f.run.track for f in fed], lists)
        done = []
        for stepper, ids, logits, (_, ngram) in zip(fed, lists, outs, guesses, strict=True):
            node, fed_guesses = stepper.run.node, len(logits) - 1
            kept, result = stepper.verify(
                logits, ids[1 : 1 + fed_guesses], lambda pos, n=node: self.passed(n, pos)
            )
            self.adapter.accept(stepper.run.track, ids, logits, kept)
            drafter.record(ngram, fed_guesses, kept - 1)
            self.stats.tokens += kept
            self.stats.drafted += fed_guesses
            self.stats.accepted += kept - 1
            if result is not None:
                done.append((node, result))
        return done


class _Stepper:
    """One `seq` node being decoded a token per model pass."""

    def __init__(self, run: Run, decoder, row, drafter=None) -> None:
        from seqkv_codecs.sequential.drafts import Stream

        self.run, self.decoder, self.row = run, decoder, row
        self.precision = decoder.precision
        self.drafter = drafter
        self.stream = Stream(run.prefix) if drafter is not None else None
        self.unfed = False  # a token is decoded that no pass has fed yet

    @classmethod
    def begin(cls, run, adapter, source: NodeSource, drafter=None):
        from seqkv_codecs.errors import CodecError
        from seqkv_codecs.sequential.node_stream import NodeDecoder
        from seqkv_codecs.sequential.probability import frequencies_from_logits
        from seqkv_codecs.sequential.token_coder import uniform_row

        if isinstance(run, Exception):
            return run
        node = source.contents.nodes[run.node]
        try:
            decoder = NodeDecoder(
                source.payload(run.node),
                node.n_tokens,
                node.check,
                source.precision,
                max_tokens=adapter.canon.max_context,
            )
        except CodecError as exc:
            return SeqkvError(f"node {run.node}: {exc}")
        row = (
            uniform_row(adapter.vocab_size, source.precision)
            if run.first_row is None
            else frequencies_from_logits(run.first_row.numpy(), source.precision)
        )
        run.tokens = decoder.out
        return cls(run, decoder, row, drafter)

    def step(self) -> Exception | None:
        """Decode the next token under the current row (unless one waits to be fed)."""
        from seqkv_codecs.errors import CodecError

        if self.unfed:
            return None
        try:
            token = self.decoder.step(self.row)
        except CodecError as exc:
            return SeqkvError(f"node {self.run.node} does not decode: {exc}")
        self.unfed = True
        if self.drafter is not None:
            self.drafter.extend(self.stream, (token,))
        return None

    def guess(self, limit: int) -> tuple[list[int], int]:
        """Guesses of the tokens after the last decoded one, at most those the node has left."""
        left = min(limit, self.run.n_tokens - self.decoder.pos)
        return self.drafter.draft(self.stream, left)

    def verify(self, logits, drafts: list[int], passed) -> tuple[int, Run | Exception | None]:
        """Rows of a pass that fed the last token, then `drafts`: decode under each row while
        the decoded token is the guess fed after it. Returns the rows kept (right guesses + 1)
        and the node's result, if it finished; `passed(pos)` is told every offset reached."""
        from seqkv_codecs.sequential.probability import frequencies_from_logits

        for j in range(len(drafts) + 1):
            result = self.took(logits[j], frequencies_from_logits(logits[j], self.precision))
            passed(self.decoder.pos)
            if result is not None or j == len(drafts):
                return j + 1, result
            error = self.step()
            if error is not None:
                return j + 1, error
            if self.last_token != drafts[j]:
                return j + 1, None  # decoded right, guessed wrong: the next pass feeds it
        raise AssertionError("unreachable")

    @property
    def last_token(self) -> int:
        return int(self.decoder.out[self.decoder.pos - 1])

    def took(self, logits: np.ndarray, freq: np.ndarray) -> Run | Exception | None:
        """The pass's logits after the last token: None while the node goes on, else the
        finished run (or the error its stream's final checks raised)."""
        from seqkv_codecs.errors import CodecError

        dec, run = self.decoder, self.run
        self.unfed = False
        run.keep_row(dec.pos, torch.from_numpy(logits.copy()))
        self.row = freq
        if dec.pos < run.n_tokens:
            return None
        if dec.done:  # decoded to its end: the stream's flush and token check must hold
            try:
                dec.close()
            except CodecError as exc:
                return SeqkvError(f"node {run.node}: {exc}")
        return run  # else stopped early: the rest of the node is not needed


def _start(adapter, parent, n, nodes, source: NodeSource, stepping: bool, limit: int) -> Run:
    node = nodes[n]
    if isinstance(parent, Exception):
        raise SeqkvError(f"its prefix could not be decoded: {parent}")
    tokens = None if stepping else source.tokens(n)
    return start_run(adapter, parent, n, node.start, node.attach, limit, tokens)


def _session(run, contents: TrieContents, s: int, entry: dict, read, canon):
    if isinstance(run, Exception):
        return SeqkvError(f"session {entry['id']}: {run}")
    rec = contents.sessions[s]
    try:
        keys, values, surprisal = session_kv(run, rec.end, DTYPES[entry["dtype"]], canon.num_layers)
        tokens = run.all_tokens(rec.end)
        # residuals resting on another session are applied once it is restored (skv.restore)
        unrounded = unrounded_kv(run.track.state, run.start + rec.end)
        return finish_capture(
            entry, read, tokens, keys, values, surprisal, deferred={}, unrounded=unrounded
        )
    except SeqkvError as exc:
        return exc
