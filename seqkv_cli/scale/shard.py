"""One shard: its sessions (token ids) -> one `.skv` trie archive, and its manifest rows.

Both the serial pipeline and the Ray actors call `build_shard`; a shard whose file already
exists with exactly the planned sessions (ids and lengths, from its index) is not rebuilt,
which is how a rerun after a crash skips the work that was finished.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from seqkv_cli.errors import SeqkvError


@dataclass
class ShardSession:
    id: str
    token_ids: np.ndarray  # int64
    prefix_key: str


def manifest_rows(path: Path, name: str, keys: dict[str, str]) -> list[dict]:
    """The manifest rows of a written shard (read from its index: nothing is decoded)."""
    from seqkv_cli.archive.summary import session_rows

    rows, _ = session_rows(path)
    return [
        {
            "session_id": r["id"],
            "shard": name,
            "tokens": int(r["positions"]),
            "bytes": int(r["own_bytes"]),
            "shared_prefix": int(r["shared_prefix"]),
            "log2_pp": math.nan if r.get("log2_ppl") is None else float(r["log2_ppl"]),
            "prefix_key": keys.get(r["id"], ""),
        }
        for r in rows
    ]


def holds_exactly(path: Path, sessions: list[ShardSession]) -> bool:
    """Whether the shard file at `path` holds these sessions (ids and lengths) and no others;
    an unreadable file does not (it is rebuilt)."""
    from seqkv_cli.skv.restore import Archive

    if not path.is_file():
        return False
    try:
        with Archive(path) as arc:
            have = {e["id"]: int(e["positions"]) for e in arc.sessions}
    except SeqkvError:
        return False
    return have == {s.id: len(s.token_ids) for s in sessions}


def build_shard(
    target: Path, name: str, sessions: list[ShardSession], lm, options: dict
) -> tuple[list[dict], bool]:
    """Write the shard to `target` (atomically) unless it is already there: its manifest
    rows and whether it was skipped. `options`: codec, numerics, verify."""
    from seqkv_cli.api.sessions import compress_sessions

    keys = {s.id: s.prefix_key for s in sessions}
    if holds_exactly(target, sessions):
        return manifest_rows(target, name, keys), True
    ordered = sorted(sessions, key=lambda s: s.id)  # the same file whatever order rows came in
    compress_sessions(
        [(s.id, s.token_ids) for s in ordered],
        target,
        lm,
        codec=options.get("codec", "seq"),
        numerics=options.get("numerics"),
        verify=bool(options.get("verify", False)),
        layout="trie",  # a shard stays appendable and keeps the full index
    )
    return manifest_rows(target, name, keys), False
