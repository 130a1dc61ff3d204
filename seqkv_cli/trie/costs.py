"""Who pays for what in a trie archive: per-session costs, shared prefixes, the trie's shape.

A node's bytes are spread over its tokens (range coding spends them per token, so this is
close; exact per-token costs would need decoding), and each token range is split equally
among the sessions whose paths cover it. Ranges one session covers are its own ("tokens");
ranges several sessions cover are the shared part ("trie"). The sums equal the file size.
"""

from __future__ import annotations

from typing import Protocol

from seqkv_cli.trie.store import TrieContents, chain


class StoredTrie(Protocol):
    """What cost accounting reads of an open trie archive (archive/restore.py's `Archive`)."""

    trie: TrieContents
    sessions: list[dict]  # header entries, archive order
    reader: object  # the container reader: `.sections` (name, length) and `.size`

    def read_part(self, segment: int, name: str) -> bytes: ...


def _node_bytes(arc: StoredTrie) -> list[float]:
    contents: TrieContents = arc.trie
    nodes = contents.nodes
    joint: dict[int, tuple[int, int]] = {}  # segment -> (token bytes, tokens) when coded jointly
    for k in contents.segments:
        tokens = sum(n.n_tokens for n in nodes if n.segment == k)
        joint[k] = (len(arc.read_part(k, "tokens")), tokens)
    out = []
    for n in nodes:
        size = n.payload + sum(n.kv_lengths)
        if n.payload == 0 and joint[n.segment][1]:
            size += joint[n.segment][0] * n.n_tokens / joint[n.segment][1]
        out.append(float(size))
    return out


def _paths(contents: TrieContents) -> list[list[tuple[int, int]]]:
    """Per session: (node, tokens of it used) from the root down."""
    out = []
    for rec in contents.sessions:
        path = chain(contents.nodes, rec.end_node)
        used = [contents.nodes[c].attach for c in path[1:]] + [rec.end]
        out.append(list(zip(path, used, strict=True)))
    return out


def session_costs(arc: StoredTrie) -> list[dict]:
    """Per session (archive order): bytes by kind and the longest prefix it shares."""
    contents = arc.trie
    nodes, node_bytes, paths = contents.nodes, _node_bytes(arc), _paths(contents)
    kv_share = [sum(n.kv_lengths) / b if b else 0.0 for n, b in zip(nodes, node_bytes, strict=True)]
    users: dict[int, list[int]] = {}  # node -> offsets each user reaches
    for path in paths:
        for n, used in path:
            users.setdefault(n, []).append(used)
    sizes = {s.name: s.length for s in arc.reader.sections}
    spent = sum(node_bytes) + sum(sizes[n] for e in arc.sessions for n in e["sections"])
    header_share = (arc.reader.size - spent) / max(len(paths), 1)
    costs = []
    for entry, path in zip(arc.sessions, paths, strict=True):
        own = own_kv = shared = 0.0
        shared_prefix = 0
        for n, used in path:
            node, reach = nodes[n], sorted(users[n])
            per_token = node_bytes[n] / node.n_tokens
            lo = 0
            for cut in sorted(set(reach)):
                if cut > used:
                    break
                covering = sum(1 for r in reach if r >= cut)  # sessions covering [lo, cut)
                if covering > 1:
                    shared += per_token * (cut - lo) / covering
                    shared_prefix = node.start + cut
                else:
                    own += per_token * (cut - lo) * (1 - kv_share[n])
                    own_kv += per_token * (cut - lo) * kv_share[n]
                lo = cut
        edits = sum(sizes[name] for name in entry["sections"] if name.endswith("/edits"))
        own += edits  # a near-duplicate's tokens are its edits
        residual = sum(sizes[name] for name in entry["sections"]) - edits
        costs.append(
            {
                "tokens": own,
                "kv": own_kv,
                "trie": shared,
                "residual": float(residual),
                "header": header_share,
                "shared_prefix": shared_prefix,
            }
        )
    return costs


def trie_shape(arc: StoredTrie) -> dict:
    """Nodes, roots, depth, cluster coverage, and the bytes prefix sharing saves (PLT bits)."""
    contents = arc.trie
    node_bytes, paths = _node_bytes(arc), _paths(contents)
    costs = session_costs(arc)
    alone = 0.0  # what every session would pay for its path coded on its own
    for path in paths:
        for n, used in path:
            alone += node_bytes[n] * used / contents.nodes[n].n_tokens
    stored = sum(node_bytes)
    return {
        "nodes": len(contents.nodes),
        "roots": sum(1 for n in contents.nodes if n.parent < 0),
        "segments": len(contents.segments),
        "depth": max((len(p) for p in paths), default=0),
        "coverage": sum(1 for c in costs if c["shared_prefix"] > 0) / max(len(costs), 1),
        "saved_bytes": alone - stored,
        "shared_prefix_bits": [c["trie"] * 8 for c in costs],
    }
