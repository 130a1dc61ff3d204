"""Which sessions are near-duplicates of which: candidate search, clustering, medoids.

Choosing centroids is a search over all sessions of a compress run (shingle index,
single-linkage clusters, medoids) with its own cost bounds; it reads alignments through
alignment.py only. Also here: the distances the benchmarks compare (`near_prefix`,
`plt_distance`).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from seqkv_cli.errors import SeqkvError
from seqkv_cli.trie.neardup.alignment import fold, opcodes, token_ids

ANCHOR = 8  # a near prefix must end on a run of at least this many equal tokens
SHINGLE = 8  # tokens per shingle: any linking pair shares one (an equal run is >= 8 tokens)
SHINGLE_SPAN = 4096  # leading tokens of a session that are shingled
MAX_CANDIDATES = 32  # partners aligned per session (the ones sharing the most shingles)
MAX_MEDOID_TRIALS = 8  # centroid candidates tried in a cluster larger than that


class Cluster(NamedTuple):
    """Sessions stored as deltas against one centroid (``members`` excludes it)."""

    centroid: str
    members: tuple[str, ...]


def _near_prefix(raw: list[tuple], max_edit_fraction: float) -> tuple[int, int]:
    """(member tokens, edited tokens) of the longest leading span aligned with few edits."""
    lead = raw[:1] if raw and raw[0][0] == "equal" else []  # an exact prefix, however short
    edited, best = 0, (0, 0)
    for tag, i1, i2, j1, j2 in lead + fold(raw[len(lead) :], ANCHOR):  # short matches: edits
        if tag != "equal":
            edited += max(i2 - i1, j2 - j1)
        elif edited <= max_edit_fraction * max(i2, j2):
            best = (j2, edited)
    return best


def near_prefix(
    centroid: np.ndarray, member: np.ndarray, *, max_edit_fraction: float = 0.05
) -> tuple[int, int]:
    """Length (in member tokens) of the leading span that aligns with at most that share of
    edited tokens, ending on an equal run of >= 8 tokens; and how many tokens it edits."""
    c, m = token_ids(centroid, "centroid"), token_ids(member, "member")
    return _near_prefix(opcodes(c, m), max_edit_fraction)


def _delta_cost(ops: list[tuple], member_side: bool) -> int:
    """Inserted tokens + runs of the folded alignment: what a delta stores beyond copies."""
    edits = [o for o in ops if o[0] != "equal"]
    return len(ops) + sum((o[4] - o[3]) if member_side else (o[2] - o[1]) for o in edits)


def _shingles(ids: np.ndarray) -> set[bytes]:
    lead = np.ascontiguousarray(ids[:SHINGLE_SPAN], dtype="<i8")
    return {lead[i : i + SHINGLE].tobytes() for i in range(max(0, len(lead) - SHINGLE + 1))}


def candidate_pairs(ids: dict[str, np.ndarray]) -> list[tuple[str, str]]:
    """Pairs that can link: they share a shingle; at most MAX_CANDIDATES partners each.

    A linking pair always shares an 8-token shingle (its aligned span ends on an equal run of
    >= 8 tokens, or is an exact prefix of >= min_prefix tokens), so with few partners per
    session this finds every pair the all-pairs loop found; beyond that it keeps the partners
    that share the most shingles. Cost: O(total shingles) to index + O(n * MAX_CANDIDATES)
    alignments, instead of O(n^2) alignments.
    """
    names = sorted(ids)
    index: dict[bytes, list[int]] = {}
    for k, n in enumerate(names):
        for sh in _shingles(ids[n]):
            index.setdefault(sh, []).append(k)
    shared: list[dict[int, int]] = [{} for _ in names]
    for posting in index.values():
        if len(posting) > 4 * MAX_CANDIDATES:  # a shingle everyone has (a common prompt) says
            posting = posting[: 4 * MAX_CANDIDATES]  # little; keep the index bounded
        for a in posting:
            for b in posting:
                if a != b:
                    shared[a][b] = shared[a].get(b, 0) + 1
    pairs = set()
    for a, partners in enumerate(shared):
        best = sorted(partners, key=lambda b: (-partners[b], b))[:MAX_CANDIDATES]
        pairs.update((min(a, b), max(a, b)) for b in best)
    return [(names[a], names[b]) for a, b in sorted(pairs)]


def cluster(
    sessions: dict[str, np.ndarray],
    max_edit_fraction: float = 0.05,
    *,
    min_prefix: int = 32,
    min_copy: int = 8,
) -> list[Cluster]:
    """Group sessions whose leading ``min_prefix``+ tokens align with few edits; pick medoids.

    Two sessions link when `near_prefix` of the pair is at least ``min_prefix`` tokens; a
    cluster is a connected component (single linkage). Its centroid is the medoid: the session
    whose delta costs (inserted tokens + runs, summed over the others) are smallest, ties to
    the first name. Only `candidate_pairs` are aligned (O(n * 32) difflib runs); a cluster of
    more than 8 sessions tries its first 8 names as centroids (O(8 * size) more). Singletons
    come back as clusters without members.
    """
    if not 0 <= max_edit_fraction < 1:
        raise SeqkvError(f"max_edit_fraction must be in [0, 1), got {max_edit_fraction}")
    names = sorted(sessions)
    ids = {n: token_ids(sessions[n], f"session {n!r}") for n in names}
    parent = {n: n for n in names}

    def root(n: str) -> str:
        while parent[n] != n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    cost: dict[tuple[str, str], int] = {}

    def align_pair(a: str, b: str) -> list[tuple]:
        raw = opcodes(ids[a], ids[b])
        folded = fold(raw, max(1, min_copy))
        cost[a, b], cost[b, a] = _delta_cost(folded, True), _delta_cost(folded, False)
        return raw

    for a, b in candidate_pairs(ids):
        if _near_prefix(align_pair(a, b), max_edit_fraction)[0] >= min_prefix:
            parent[root(b)] = root(a)
    groups: dict[str, list[str]] = {}
    for n in names:
        groups.setdefault(root(n), []).append(n)

    def total_cost(c: str, group: list[str]) -> int:
        for m in group:
            if m != c and (c, m) not in cost:
                align_pair(*sorted((c, m)))
        return sum(cost[c, m] for m in group if m != c)

    out = []
    for group in groups.values():
        trials = group if len(group) <= MAX_MEDOID_TRIALS else group[:MAX_MEDOID_TRIALS]
        medoid = min(trials, key=lambda c: total_cost(c, group))
        out.append(Cluster(medoid, tuple(m for m in group if m != medoid)))
    return sorted(out)


def plt_distance(
    surprisal_bits: np.ndarray, common_prefix_len: int, *, first_token_bits: float = 0.0
) -> float:
    """d_T = -log2 P_M(common prefix): the bits a trie saves by storing that prefix once.

    ``surprisal_bits`` follows the capture layout: entry i is the cost of token i + 1 (the
    first token has none; pass ``first_token_bits``, e.g. log2 V, to count it).
    """
    s = np.asarray(surprisal_bits, dtype=np.float64)
    if s.ndim != 1 or not 0 <= common_prefix_len <= len(s) + 1:
        raise SeqkvError(
            f"common prefix of {common_prefix_len} tokens does not fit a session of "
            f"{len(s) + 1} tokens"
        )
    if common_prefix_len == 0:
        return 0.0
    return float(first_token_bits + s[: common_prefix_len - 1].sum())
