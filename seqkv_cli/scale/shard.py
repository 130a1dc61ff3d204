"""One shard: its sessions (token ids) -> one `.skv` trie archive, and its manifest rows.

Both the serial pipeline and the Ray actors call `build_shard`. A shard whose file already
holds provably what this run would write is not rebuilt, which is how a rerun after a crash
skips the work that was finished. Provably: every shard records in its header's meta
(`content`) a digest of each session's token ids and the settings that decide its bytes
(model fingerprint, codec config, layout), written in the same atomic publish as the shard;
a rerun compares them with its own. Ids and lengths alone are not enough: a session whose
text was corrected to another of the same token count would be kept stale. A
shard without the record (written by seqkv 0.5 or earlier) is not provably complete: rebuilt.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from seqkv_cli.archive import CONTENT_KEY, token_digest
from seqkv_cli.errors import SeqkvError

CONTENT_VERSION = 1


@dataclass
class ShardSession:
    id: str
    token_ids: np.ndarray  # int64
    prefix_key: str


def shard_settings(lm, options: dict) -> dict:
    """What besides the tokens decides a shard's bytes: the model, the codec's config (its
    numeric path included) and the layout. `options`: codec, numerics (verify does not)."""
    from seqkv_cli.api import session_codec

    coder = session_codec(options.get("codec", "seq"), options.get("numerics"))
    config = json.loads(json.dumps(coder.get_config()))  # as the header will hold it
    return {"model": lm.fingerprint, "codec": config, "layout": "trie"}


def content_record(sessions: list[ShardSession], settings: dict) -> dict:
    """The `content` record a shard of these sessions, built with these settings, carries."""
    return {
        "version": CONTENT_VERSION,
        "settings": settings,
        "tokens": {s.id: token_digest(s.token_ids) for s in sorted(sessions, key=lambda s: s.id)},
    }


def recorded_content(path: Path) -> tuple[dict, dict] | None:
    """(session id -> positions, the `content` record) of the shard at `path`; None when
    there is no readable shard there."""
    from seqkv_cli.archive import Archive

    if not path.is_file():
        return None
    try:
        with Archive(path) as arc:
            held = {e["id"]: int(e["positions"]) for e in arc.sessions}
            record = (arc.reader.header.get("meta") or {}).get(CONTENT_KEY)
    except SeqkvError:
        return None
    return held, record if isinstance(record, dict) else {}


def provably_complete(path: Path, sessions: list[ShardSession], settings: dict) -> bool:
    """Whether the shard file at `path` holds exactly these sessions (ids and lengths from
    its index, content by digest from its record) built with these settings: what this run
    would write. An unreadable file, or one without the record, is not (it is rebuilt)."""
    found = recorded_content(path)
    if found is None:
        return False
    held, record = found
    if held != {s.id: len(s.token_ids) for s in sessions}:
        return False
    return record == content_record(sessions, settings)


def manifest_rows(path: Path, name: str, keys: dict[str, str]) -> list[dict]:
    """The manifest rows of a written shard (read from its index and its content record:
    nothing is decoded)."""
    from seqkv_cli.archive import session_rows

    rows, _ = session_rows(path)
    found = recorded_content(path)
    digests = (found[1].get("tokens") if found else None) or {}
    return [
        {
            "session_id": r["id"],
            "shard": name,
            "tokens": int(r["positions"]),
            "bytes": int(r["own_bytes"]),
            "shared_prefix": int(r["shared_prefix"]),
            "log2_pp": math.nan if r.get("log2_ppl") is None else float(r["log2_ppl"]),
            "prefix_key": keys.get(r["id"], ""),
            "content": str(digests.get(r["id"], "")),
        }
        for r in rows
    ]


def build_shard(
    target: Path, name: str, sessions: list[ShardSession], lm, options: dict
) -> tuple[list[dict], bool]:
    """Write the shard to `target` (atomically) unless it is provably there already: its
    manifest rows and whether it was skipped. `options`: codec, numerics, verify."""
    from seqkv_cli.api import compress_sessions

    keys = {s.id: s.prefix_key for s in sessions}
    settings = shard_settings(lm, options)
    if provably_complete(target, sessions, settings):
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
        file_meta={CONTENT_KEY: content_record(sessions, settings)},
    )
    return manifest_rows(target, name, keys), False
