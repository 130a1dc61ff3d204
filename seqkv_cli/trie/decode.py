"""Restoring sessions from a trie archive, decoding only the nodes on their paths.

Nodes are decoded parent first; each starts from a fork of its parent's state at its branch
point. `seq` nodes step the model once per token, several nodes in lockstep as rows of one
pass, in the order trie/schedule.py decides; `seq-fast` nodes are one prefill each (an archive
may hold both: each segment says which codec coded it, `TrieContents.codecs`). A node is
released once its children have started and its sessions are out, so memory holds the
current frontier, not the archive. Reading nodes: node_source.py; one node's token-by-token
decoding and its guesses: node_stepper.py; a finished node's run becomes a session's capture
here (`session_capture`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from seqkv_cli.errors import SeqkvError
from seqkv_cli.kvcapture.capture_file import DTYPES
from seqkv_cli.sequential.adapter import CanonicalLogits, drafts_enabled, unrounded_kv
from seqkv_cli.sequential.load_modes import segment_codec
from seqkv_cli.sequential.registry import capabilities
from seqkv_cli.sequential.session_codec import finish_capture
from seqkv_cli.trie.node_source import NodeSource
from seqkv_cli.trie.node_stepper import NodeStepper
from seqkv_cli.trie.runs import Run, prefill, session_kv, start_run
from seqkv_cli.trie.schedule import NeededNodes, Schedule, needed_nodes
from seqkv_cli.trie.store import TrieContents
from seqkv_cli.trie.tables import Node

if TYPE_CHECKING:
    from seqkv_cli.runtime.forward import CanonicalForward
    from seqkv_cli.sequential.session_codec import SessionCodec


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


def decode_sessions(
    contents: TrieContents,
    wanted: list[int],
    source: NodeSource,
    codec: SessionCodec,
    canon: CanonicalForward,
    entries: dict[int, dict],
    reads: dict[int, Callable[[str], bytes | None]],
    stats: DecodeStats | None = None,
) -> Iterator[tuple[int, object]]:
    """Yield (session index, Capture or the SeqkvError that stopped it) as sessions finish;
    `stats`, if given, is filled with what the `seq` decoding cost. `codec` is the archive's;
    a segment coded by another says so in its table."""
    need = needed_nodes(contents, wanted)
    stats = stats if stats is not None else DecodeStats()
    stats.total += sum(need.limit.values())
    steps = node_steps(contents, codec)
    decoding = _Decoding(CanonicalLogits(canon), contents.nodes, need, source, stats, steps)
    stepping = any(steps[n] for n in need.limit)
    for n, done in decoding.stepped() if stepping else decoding.prefilled():
        for s in need.ending.get(n, []):
            yield s, session_capture(done, contents, s, entries[s], reads[s], canon)


def node_steps(contents: TrieContents, codec: SessionCodec) -> list[bool]:
    """Per node: whether its tokens are decoded by stepping the model (`seq`) rather than
    read and prefilled (`seq-fast`), by the codec of the segment that holds it."""
    segment_steps = {
        k: capabilities(segment_codec(codec, contents.codecs.get(k), k)).steps_model
        for k in contents.segments
    }
    return [segment_steps[node.segment] for node in contents.nodes]


def session_capture(
    run: Run | Exception,
    contents: TrieContents,
    s: int,
    entry: dict,
    read: Callable[[str], bytes | None],
    canon: CanonicalForward,
):
    """Session `s` (its entry, its parts' reader) as a Capture from `run` (its end node's
    run, or the error that stopped it), or the SeqkvError that stops the session."""
    if isinstance(run, Exception):
        return SeqkvError(f"session {entry['id']}: {run}")
    rec = contents.sessions[s]
    try:
        keys, values, surprisal = session_kv(run, rec.end, DTYPES[entry["dtype"]], canon.num_layers)
        tokens = run.all_tokens(rec.end)
        # residuals resting on another session are applied once it is restored
        # (archive/restore_trie.py)
        unrounded = unrounded_kv(run.track.state, run.start + rec.end)
        return finish_capture(
            entry, read, tokens, keys, values, surprisal, deferred={}, unrounded=unrounded
        )
    except SeqkvError as exc:
        return exc


class _Decoding:
    """The model passes of one restore, and when their results are final.

    The Schedule says which nodes hold the rows of each pass. A result is final once every
    ancestor has passed its own end checks: a child that finishes first waits, and one whose
    ancestor fails fails with it (its prefix was decoded from a damaged stream).
    """

    def __init__(
        self,
        adapter: CanonicalLogits,
        nodes: list[Node],
        need: NeededNodes,
        source: NodeSource,
        stats: DecodeStats,
        steps: list[bool],
    ) -> None:
        self.adapter, self.nodes, self.kids, self.limit = adapter, nodes, need.kids, need.limit
        self.source, self.stats, self.steps = source, stats, steps
        self.schedule = Schedule(nodes, need.kids)
        self.alive: dict[int, Run | Exception] = {}  # states children still fork from
        self.pending_kids = {n: len(self.kids.get(n, [])) for n in self.limit}
        self.finished: dict[int, Run | Exception] = {}  # done, an ancestor not yet settled
        # final: None, or the error that stopped the node (its children fail with it). Not
        # the run: kept here, every node of a chain of turns would keep its state to the end.
        self.settled: dict[int, Exception | None] = {}

    def fork_or_error(self, n: int, stepping: bool) -> Run | Exception:
        """The node's run, forked from its parent (whose state is dropped after its last
        child has forked and it is settled), or the error that prevents it."""
        node = self.nodes[n]
        parent = self.alive.get(node.parent)
        try:
            if isinstance(parent, Exception):
                raise SeqkvError(f"its prefix could not be decoded: {parent}")
            tokens = None if stepping else self.source.tokens(n)
            run = start_run(self.adapter, parent, n, node.start, node.attach, self.limit[n], tokens)
            run.want_rows = {self.nodes[c].attach for c in self.kids.get(n, [])}
        except SeqkvError as exc:
            run = exc
        if node.parent >= 0:
            self.pending_kids[node.parent] -= 1
            if self.pending_kids[node.parent] == 0 and node.parent in self.settled:
                self.alive.pop(node.parent, None)
        if self.pending_kids[n]:
            self.alive[n] = run
        return run

    def finish(self, n: int, done: Run | Exception) -> list[tuple[int, Run | Exception]]:
        """Record a node's result and free its row; return the results this makes final,
        parents first."""
        if self.pending_kids[n]:
            self.alive[n] = done
        self.schedule.leave(n)
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
            self.settled[m] = result if isinstance(result, Exception) else None
            if self.pending_kids[m] == 0:
                self.alive.pop(m, None)
            else:
                self.alive[m] = result
            out.append((m, result))
            todo.extend(c for c in self.kids.get(m, []) if c in self.finished)
        return out

    def prefilled(self) -> Iterator[tuple[int, Run | Exception]]:
        """seq-fast: each node is one prefill of its known tokens, one node at a time."""
        while self.schedule.busy:
            for n in self.schedule.admit():
                yield from self._prefilled(n)

    def _prefilled(self, n: int) -> list[tuple[int, Run | Exception]]:
        """One node whose tokens are known: forked, prefilled and finished at once."""
        run = self.fork_or_error(n, stepping=False)
        if isinstance(run, Run):
            prefill(self.adapter, run)
            self.stats.tokens += run.n_tokens
            self.stats.report()
        self.adapter.tracks.clear()
        return self.finish(n, run)

    def stepped(self) -> Iterator[tuple[int, Run | Exception]]:
        """seq: every running node steps once per model pass, as one row of it; a node that
        becomes ready takes a free row at the next pass (continuous batching). A node's row
        carries guesses of its next tokens when the decoded text suggests some (drafts.py):
        each right guess is a token decoded in the same pass. A node whose tokens are known
        (a `seq-fast` segment of the same archive) is prefilled when its turn comes."""
        from seqkv_codecs.sequential.drafts import MAX_DRAFT, ROW_BUDGET, DraftIndex

        drafter = DraftIndex() if drafts_enabled() else None
        active: dict[int, NodeStepper] = {}
        while self.schedule.busy:
            for n in self.schedule.admit():
                if not self.steps[n]:
                    yield from self._prefilled(n)
                    continue
                run = self.fork_or_error(n, stepping=True)
                stepper = NodeStepper.open_or_error(run, self.adapter, self.source, drafter)
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

    def _reached(self, n: int, pos: int) -> None:
        """Node `n` has decoded `pos` tokens: children branching there can start."""
        self.schedule.advanced(n, pos - 1, pos)

    def _single_rows(self, fed: list[NodeStepper]) -> list:
        """One token per node: the pass of a decoder without guesses."""
        from seqkv_codecs.sequential.probability import frequencies_from_logits

        ids = np.array([f.last_token for f in fed], dtype=np.int64)
        logits = self.adapter.feed_rows([f.run.track for f in fed], ids)
        freqs = frequencies_from_logits(logits, self.source.precision)
        done = []
        for i, stepper in enumerate(fed):
            self.stats.tokens += 1
            result = stepper.result_after_pass(logits[i], freqs[i])
            self._reached(stepper.run.node, stepper.decoder.pos)
            if result is not None:
                done.append((stepper.run.node, result))
        return done

    def _draft_rows(self, fed: list[NodeStepper], guesses: list, drafter) -> list:
        """Each node's last token and its guesses in one pass; keep what the stream confirms."""
        lists = [[f.last_token, *g] for f, (g, _) in zip(fed, guesses, strict=True)]
        outs = self.adapter.feed_drafts([f.run.track for f in fed], lists)
        done = []
        for stepper, ids, logits, (_, ngram) in zip(fed, lists, outs, guesses, strict=True):
            node, fed_guesses = stepper.run.node, len(logits) - 1
            kept, result = stepper.verify(
                logits, ids[1 : 1 + fed_guesses], lambda pos, n=node: self._reached(n, pos)
            )
            self.adapter.accept(stepper.run.track, ids, logits, kept)
            drafter.record(ngram, fed_guesses, kept - 1)
            self.stats.tokens += kept
            self.stats.drafted += fed_guesses
            self.stats.accepted += kept - 1
            if result is not None:
                done.append((node, result))
        return done
