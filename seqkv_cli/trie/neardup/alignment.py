"""Token alignment of a near-duplicate member against its centroid, as copy/delete/insert runs.

What a member shares with its centroid is decided here and only here: the clustering prices
candidate deltas with these alignments and the edit stream stores the edits they produce, so
both see the same runs. Exact-prefix dedup stops at the first differing token; an alignment
(difflib's) keeps going, so "You are a helpful …" and "You are an AI …" share every token
after the edit too.
"""

from __future__ import annotations

from difflib import SequenceMatcher
from typing import NamedTuple

import numpy as np

from seqkv_cli.errors import SeqkvError

COPY, DELETE, INSERT = "copy", "delete", "insert"


class Edit(NamedTuple):
    """One run: copy or delete ``length`` centroid tokens, or insert ``tokens``."""

    op: str
    length: int
    tokens: tuple[int, ...] = ()


def token_ids(a: object, what: str) -> np.ndarray:
    """``a`` as int64 token ids; anything but a 1-D array of non-negative integers is refused."""
    x = np.asarray(a)
    if x.ndim != 1 or (x.size and x.dtype.kind not in "iu") or (x.size and x.min() < 0):
        raise SeqkvError(f"{what} must be a 1-D array of non-negative token ids")
    return x.astype(np.int64)


def opcodes(centroid: np.ndarray, member: np.ndarray) -> list[tuple]:
    """difflib's opcodes (tag, i1, i2, j1, j2) turning ``centroid`` into ``member``."""
    sm = SequenceMatcher(None, centroid.tolist(), member.tolist(), autojunk=False)
    return sm.get_opcodes()


def fold(raw: list[tuple], min_copy: int) -> list[tuple]:
    """Opcodes with equal runs shorter than ``min_copy`` merged into the edits around them.

    The result holds ``"equal"`` runs and ``"edit"`` runs (a replace, delete or insert, or
    several of them with short equal runs between).
    """
    out: list[list] = []
    for tag, i1, i2, j1, j2 in raw:
        tag = "equal" if tag == "equal" and i2 - i1 >= min_copy else "edit"
        if out and out[-1][0] == tag == "edit":
            out[-1][2], out[-1][4] = i2, j2
        else:
            out.append([tag, i1, i2, j1, j2])
    return [tuple(o) for o in out]


def align(centroid: np.ndarray, member: np.ndarray, *, min_copy: int = 8) -> list[Edit]:
    """Edits turning ``centroid`` into ``member``; equal runs under ``min_copy`` are re-inserted.

    Short coincidental matches (chat-template tokens in unrelated tails) cost an op each as
    copies but nearly nothing when the model codes them, hence ``min_copy``.
    """
    c, m = token_ids(centroid, "centroid"), token_ids(member, "member")
    edits = []
    for tag, i1, i2, j1, j2 in fold(opcodes(c, m), max(1, min_copy)):
        if tag == "equal":
            edits.append(Edit(COPY, i2 - i1))
            continue
        if i2 > i1:
            edits.append(Edit(DELETE, i2 - i1))
        if j2 > j1:
            edits.append(Edit(INSERT, j2 - j1, tuple(m[j1:j2].tolist())))
    return edits


def apply_edits(edits: list[Edit], centroid: np.ndarray) -> np.ndarray:
    """The member the edits describe; they must consume the centroid exactly."""
    c, out, pos = token_ids(centroid, "centroid"), [], 0
    for e in edits:
        if e.op == INSERT:
            out.append(np.asarray(e.tokens, np.int64))
        elif e.op in (COPY, DELETE) and pos + e.length <= len(c):
            if e.op == COPY:
                out.append(c[pos : pos + e.length])
            pos += e.length
        else:
            raise SeqkvError(f"edit {e.op} x{e.length} at centroid token {pos} does not fit it")
    if pos != len(c):
        raise SeqkvError(f"edits consume {pos} centroid tokens, the centroid has {len(c)}")
    return np.concatenate(out) if out else np.zeros(0, np.int64)


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    """Tokens shared from the start: where an exact-prefix trie branches."""
    x, y = token_ids(a, "a"), token_ids(b, "b")
    n = min(len(x), len(y))
    diff = np.flatnonzero(x[:n] != y[:n])
    return int(diff[0]) if diff.size else n
