"""The order a `seq` trie restore decodes its nodes in, for the restore and its estimate.

A restore decodes only the nodes on its sessions' paths, each only as far as its sessions and
children reach (`needed_nodes`). `Schedule` decides which nodes hold the rows of each model
pass: up to LOCKSTEP rows; a root is ready at once, a child as soon as its parent's decoder
passes its branch point (nodes are never split, so most children branch off inside their
parent); a ready node takes a free row at the next pass, in the order nodes became ready.

One schedule, two users: the restore (trie/decode.py) runs it, feeding each pass's rows to the
model; the restore-time estimate (archive/restore_time.py) only counts its passes
(`planned_passes`). A rule changed here changes both.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from seqkv_cli.trie.store import TrieContents, chain

if TYPE_CHECKING:
    from seqkv_cli.trie.tables import Node

LOCKSTEP = 16  # seq nodes stepped together (memory: one K/V state each)


@dataclass
class NeededNodes:
    """What restoring some sessions decodes."""

    kids: dict[int, list[int]]  # {parent: its needed children}, roots under -1
    ending: dict[int, list[int]]  # {node: the wanted sessions ending in it}
    limit: dict[int, int]  # {node: how many of its tokens are decoded}


def needed_nodes(contents: TrieContents, wanted: list[int]) -> NeededNodes:
    """The nodes restoring the sessions `wanted` decodes, and how far."""
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
    return NeededNodes(kids, ending, limit)


class Schedule:
    """Nodes waiting for a row (`ready`) and nodes holding one (`running`)."""

    def __init__(self, nodes: list[Node], kids: dict[int, list[int]]) -> None:
        self.nodes, self.kids = nodes, kids
        self.rows = LOCKSTEP  # read here, not at import: tests narrow it
        self.ready: deque[int] = deque()
        self.running: set[int] = set()
        self._queued: set[int] = set()
        self._queue(kids.get(-1, []))

    @property
    def busy(self) -> bool:
        return bool(self.ready or self.running)

    def admit(self) -> Iterator[int]:
        """The ready nodes that take the free rows of the next pass, in the order they became
        ready. Lazy: a node that leaves before the next is asked for (its start failed) frees
        its row for that one."""
        while self.ready and len(self.running) < self.rows:
            n = self.ready.popleft()
            self.running.add(n)
            yield n

    def advanced(self, n: int, before: int, after: int) -> None:
        """Node `n` went from `before` to `after` decoded tokens: children branching off in
        between (after their parent's token `attach`) are ready."""
        self._queue(c for c in self.kids.get(n, []) if before < self.nodes[c].attach <= after)

    def leave(self, n: int) -> None:
        """Node `n` is done (or failed): its row is free, and children it never reached are
        ready too (they fail when they start)."""
        self.running.discard(n)
        self._queue(self.kids.get(n, []))

    def _queue(self, nodes) -> None:
        for n in nodes:
            if n not in self._queued:
                self._queued.add(n)
                self.ready.append(n)


def planned_passes(contents: TrieContents, wanted: list[int]) -> tuple[int, int]:
    """(model passes, tokens) a `seq` restore of `wanted` needs without guesses: the restore's
    Schedule run on node lengths alone, every row gaining one token a pass (the estimate of
    archive.restore_time). Passes in which nothing but tokens happen are counted in one jump."""
    need = needed_nodes(contents, wanted)
    schedule = Schedule(contents.nodes, need.kids)
    done: dict[int, int] = {}  # tokens decoded by each node holding a row
    passes = 0
    while schedule.busy:
        for n in schedule.admit():
            done[n] = 0
        span = _passes_to_next_event(schedule, done, need.limit)
        passes += span
        for n in list(done):
            before = done[n]
            done[n] = min(before + span, need.limit[n])
            schedule.advanced(n, before, done[n])
            if done[n] >= need.limit[n]:
                del done[n]
                schedule.leave(n)
    return passes, sum(need.limit.values())


def _passes_to_next_event(schedule: Schedule, done: dict[int, int], limit) -> int:
    """Passes until a running node ends or passes a child's branch point: until then the
    schedule's rows do not change."""
    nodes, kids = schedule.nodes, schedule.kids
    events = [limit[n] - at for n, at in done.items()]
    events += [
        nodes[c].attach - at
        for n, at in done.items()
        for c in kids.get(n, [])
        if nodes[c].attach > at
    ]
    return max(1, min(events)) if events else 1
