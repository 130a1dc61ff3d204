"""Where each session goes in the trie: the longest shared prefix, then one new branch.

Nodes never split: a branch may start *inside* its parent (after `attach` of the parent's
tokens), so an append-only archive grows without rewriting a node, and a session costs
exactly the tokens no earlier session has at the same prefix. compress inserts shorter
sessions first, so a session that is a prefix of another ends where a node ends; `archive
compact` inserts longer ones first, so a chain of turns becomes one node.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class PlanNode:
    parent: int  # -1 for a root
    attach: int
    start: int
    tokens: np.ndarray | None  # None: an archived `seq` node, known only by decoding it
    creator: int  # the session whose tokens created the node (index in the caller's list)
    length: int = -1

    def __post_init__(self) -> None:
        if self.tokens is not None:
            self.length = len(self.tokens)


@dataclass
class Trie:
    """Nodes with known tokens, and which children hang where; new nodes are appended."""

    nodes: list[PlanNode] = field(default_factory=list)
    children: dict[int, list[int]] = field(default_factory=dict)

    def add(self, node: PlanNode) -> int:
        self.nodes.append(node)
        index = len(self.nodes) - 1
        self.children.setdefault(node.parent, []).append(index)
        return index

    def longest_match(self, tokens: np.ndarray) -> tuple[int, int, int]:
        """(node, tokens of it matched, total matched) of the deepest path `tokens` follows."""
        best = (-1, 0, 0)
        stack = list(self.children.get(-1, []))
        while stack:
            n = stack.pop()
            node = self.nodes[n]
            m = common_prefix(node.tokens, tokens[node.start :])
            if node.start + m > best[2]:
                best = (n, m, node.start + m)
            stack += [c for c in self.children.get(n, []) if self.nodes[c].attach <= m]
        return best

    def normalise(self, node: int, offset: int) -> tuple[int, int]:
        """(node, offset) with offset >= 1, moving up while a point sits at a node's start."""
        while node >= 0 and offset == 0:
            node, offset = self.nodes[node].parent, self.nodes[node].attach
        return node, offset

    def insert(self, tokens: np.ndarray, creator: int) -> tuple[int, int, int | None]:
        """Place a session; returns (end node, end offset, index of the new node or None)."""
        node, offset, matched = self.longest_match(tokens)
        if matched == len(tokens):
            node, offset = self.normalise(node, offset)
            return node, offset, None
        parent, attach = self.normalise(node, offset)
        start = 0 if parent < 0 else self.nodes[parent].start + attach
        new = self.add(PlanNode(parent, attach, start, tokens[start:].copy(), creator))
        return new, len(tokens) - start, new


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def insertion_order(lengths: list[int], merge_prefixes: bool = False) -> list[int]:
    """Shortest first (stable), as an agent's snapshots arrive: a session that prefixes a
    longer one then ends at the end of its own node, so restoring it decodes no token of
    the longer one and checks its node's token checksum.

    `merge_prefixes`: longest first, so such a session ends inside the longer one's node.
    A chain of 50 turns is then one node and one token stream instead of 50 (each node costs
    a table row and, for `seq`, a stream flush); an early turn is then decoded short of the
    node's checksum and checked by its log2 PP alone (archive/restore_trie.py)."""
    if merge_prefixes:
        return sorted(range(len(lengths)), key=lambda i: -lengths[i])
    return sorted(range(len(lengths)), key=lambda i: lengths[i])
