"""A directory of shard archives read as one logical archive, through its manifest.

`manifest.parquet` (written last, atomically, by the sharded and Ray pipelines) has one row
per session: its id, the shard file that holds it, tokens, own bytes, shared prefix, log2 PP,
the prefix key that placed it and (version 2) a digest of its token ids. Its schema metadata
names the model every shard must be of and (version 2) the settings the shards were built
with. Each shard records the same digests and settings in its own header (`CONTENT_KEY`),
published with it: what a rerun compares before it keeps a shard (scale/shard.py).
docs/FORMAT.md, "Shard manifests", specifies both.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from seqkv_cli.archive.identity import fingerprint_matches
from seqkv_cli.archive.restore import Archive
from seqkv_cli.errors import SeqkvError
from seqkv_cli.fsutil import atomic_path

MANIFEST_NAME = "manifest.parquet"
MANIFEST_VERSION = 2  # 2 added the `content` column and the `settings` metadata
META_KEY = b"seqkv_manifest"
CONTENT_KEY = "content"  # a shard header's meta entry: {"version", "settings", "tokens"}
CONTENT_COLUMN = "content"  # version 2: token_digest of the session's token ids
# The columns of every version (a version 1 manifest has exactly these).
COLUMNS = {
    "session_id": "string",
    "shard": "string",
    "tokens": "int64",
    "bytes": "int64",
    "shared_prefix": "int64",
    "log2_pp": "float64",
    "prefix_key": "string",
}


def token_digest(token_ids: Sequence[int] | np.ndarray) -> str:
    """32 hex digits naming a session's content: BLAKE2b-128 of its token ids as <u4."""
    raw = np.asarray(token_ids, dtype=np.int64).astype("<u4").tobytes()
    return hashlib.blake2b(raw, digest_size=16).hexdigest()


@dataclass
class Manifest:
    """A read manifest: its directory, the model it names, and its rows (a DataFrame with
    COLUMNS and `content`, "" in a version 1 manifest, which has no digests)."""

    root: Path
    model: dict
    rows: object  # pandas.DataFrame with COLUMNS
    meta: dict

    def shards(self) -> list[Path]:
        return [self.root / name for name in sorted(set(self.rows["shard"]))]

    def shard_of(self, session_id: str) -> Path:
        hit = self.rows.index[self.rows["session_id"] == session_id]
        if len(hit) == 0:
            raise SeqkvError(f"{self.root / MANIFEST_NAME} has no session {session_id!r}")
        return self.root / str(self.rows.at[hit[0], "shard"])


def manifest_file(path: Path) -> Path | None:
    """The manifest `path` names: a manifest file, or a directory holding one; else None."""
    path = Path(path)
    if path.is_dir():
        candidate = path / MANIFEST_NAME
        return candidate if candidate.is_file() else None
    if path.suffix == ".parquet" and path.is_file():
        return path
    return None


def read_manifest(path: Path, *, check_shards: bool = True) -> Manifest:
    """Read and check a manifest; `check_shards` opens every shard's header and refuses a
    missing shard or one of another model (one line each, naming it)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    file = manifest_file(path)
    if file is None:
        raise SeqkvError(f"{path} holds no {MANIFEST_NAME} (not a sharded archive)")
    try:
        table = pq.read_table(file)
    except (OSError, pa.ArrowException) as exc:
        raise SeqkvError(f"{file} is not a readable manifest ({exc})") from None
    raw = (table.schema.metadata or {}).get(META_KEY)
    if raw is None:
        raise SeqkvError(f"{file} is a Parquet file but not a seqkv shard manifest")
    try:
        meta = json.loads(raw)
        version, model = meta["version"], meta["model"]
        fingerprint = model["fingerprint"]
    except (ValueError, KeyError, TypeError, RecursionError):
        raise SeqkvError(f"{file}: malformed manifest metadata") from None
    if not (
        isinstance(version, int)
        and not isinstance(version, bool)
        and isinstance(model, dict)
        and isinstance(fingerprint, str)
    ):
        raise SeqkvError(f"{file}: malformed manifest metadata (version, model, fingerprint)")
    if version > MANIFEST_VERSION:
        raise SeqkvError(
            f"{file} is manifest version {version}; this seqkv reads up to "
            f"{MANIFEST_VERSION} (upgrade seqkv)"
        )
    _check_schema(file, table, version)
    columns = [*COLUMNS, CONTENT_COLUMN] if version >= 2 else list(COLUMNS)
    rows = table.select(columns).to_pandas()
    if version < 2:
        rows[CONTENT_COLUMN] = ""
    for name in set(rows["shard"]):
        if not _plain_shard_name(name):
            raise SeqkvError(f"{file}: shard name {str(name)[:80]!r} is not a .skv file name")
    dup = rows["session_id"].duplicated()
    if dup.any():
        raise SeqkvError(
            f"{file}: session id {rows['session_id'][dup].iloc[0][:80]!r} is listed twice"
        )
    manifest = Manifest(file.parent, model, rows, meta)
    if check_shards:
        _check_against_shards(file, manifest, fingerprint)
    return manifest


def _check_schema(file: Path, table, version: int) -> None:
    """Every column there, of its type, with no empty cells (log2 PP may be unknown), and
    counts that can be counts: checked on whole columns, not row by row."""
    import pyarrow as pa
    import pyarrow.compute as pc

    expected = dict(COLUMNS, **({CONTENT_COLUMN: "string"} if version >= 2 else {}))
    missing = [c for c in expected if c not in table.column_names]
    if missing:
        raise SeqkvError(f"{file}: manifest lacks the column(s) {', '.join(missing)}")
    allowed = {"string": (pa.string(), pa.large_string()), "int64": (pa.int64(),)}
    allowed["float64"] = (pa.float64(),)
    for name, kind in expected.items():
        column = table.column(name)
        if column.type not in allowed[kind]:
            raise SeqkvError(f"{file}: manifest column {name} holds {column.type}, not {kind}")
        if name != "log2_pp" and column.null_count:
            raise SeqkvError(f"{file}: manifest column {name} has empty cells")
    for name in ("tokens", "bytes", "shared_prefix"):
        low = pc.min(table.column(name)).as_py()
        if low is not None and low < 0:
            raise SeqkvError(f"{file}: manifest column {name} holds {low}, not a count")
    if (
        table.num_rows
        and pc.any(pc.greater(table.column("shared_prefix"), table.column("tokens"))).as_py()
    ):
        raise SeqkvError(f"{file}: a manifest row shares more prefix than it has tokens")
    if version >= 2 and table.num_rows:
        digest = pc.match_substring_regex(table.column(CONTENT_COLUMN), "^[0-9a-f]{32}$")
        if not pc.all(digest).as_py():
            raise SeqkvError(f"{file}: manifest column content holds a value that is no digest")


def _check_against_shards(file: Path, manifest: Manifest, fingerprint: str) -> None:
    """Each shard is there, of the manifest's model, and holds exactly the sessions the
    manifest lists for it with the token counts it gives (read from the shards' headers).
    Bytes and shared prefixes are what the writer measured; `archive list` says so."""
    import pandas as pd

    # The pipeline deletes shards of earlier plans once the manifest is written, so a shard
    # file beside the manifest that it does not list means rows were lost (or that run died
    # in between): listing the rest would hide those sessions.
    listed = {shard.name for shard in manifest.shards()}
    for other in sorted(manifest.root.glob("shard-*.skv")):
        if other.name not in listed:
            raise SeqkvError(
                f"{file} does not list {other.name}, which lies beside it: an incomplete "
                "manifest, or a run that was interrupted (run the compress again)"
            )
    held = []
    for shard in manifest.shards():
        if not shard.is_file():
            raise SeqkvError(f"{file} lists {shard.name}, which is missing")
        with Archive(shard) as arc:
            got = str(arc.model.get("fingerprint", "?"))
            record = (arc.reader.header.get("meta") or {}).get(CONTENT_KEY)
            digests = record.get("tokens") if isinstance(record, dict) else None
            digests = digests if isinstance(digests, dict) else {}
            held += [
                (shard.name, e["id"], e["positions"], str(digests.get(e["id"], "")))
                for e in arc.sessions
            ]
        if not fingerprint_matches(got, fingerprint):
            raise SeqkvError(
                f"{shard} holds sessions of another model (fingerprint {got[:16]}) than "
                f"{file} names ({fingerprint[:16]}); one manifest holds one model"
            )
    shards = pd.DataFrame(held, columns=["shard", "session_id", "positions", "held_content"])
    both = manifest.rows.merge(shards, on=["shard", "session_id"], how="outer", indicator=True)
    listed_only = both[both["_merge"] == "left_only"]
    if len(listed_only):
        row = listed_only.iloc[0]
        raise SeqkvError(
            f"{file} lists session {str(row.session_id)[:80]!r} in {row.shard}, which does "
            "not hold it"
        )
    held_only = both[both["_merge"] == "right_only"]
    if len(held_only):
        row = held_only.iloc[0]
        raise SeqkvError(
            f"{row.shard} holds session {str(row.session_id)[:80]!r}, which {file} does not list"
        )
    wrong = both[both["tokens"] != both["positions"]]
    if len(wrong):
        row = wrong.iloc[0]
        raise SeqkvError(
            f"{file} says session {str(row.session_id)[:80]!r} has {int(row.tokens):,} "
            f"tokens; {row.shard} holds {int(row.positions):,}"
        )
    # version 2: the content a row names is the content its shard recorded (a shard written
    # by a later run whose manifest was never written holds other tokens)
    stale = both[(both[CONTENT_COLUMN] != "") & (both[CONTENT_COLUMN] != both["held_content"])]
    if len(stale):
        row = stale.iloc[0]
        raise SeqkvError(
            f"{file} names other content for session {str(row.session_id)[:80]!r} than "
            f"{row.shard} holds: a stale manifest (run the compress again)"
        )


def write_manifest(root: Path, rows: list[dict], model: dict, extra: dict | None = None) -> Path:
    """Write `root/manifest.parquet` atomically (`fsutil.publish`), version 2: every row
    has a `content` digest; `extra` goes to the metadata (the pipeline's `settings`...)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    ordered = sorted(rows, key=lambda r: (r["shard"], r["session_id"]))
    arrays = {
        name: pa.array([r[name] for r in ordered], type=getattr(pa, kind)())
        for name, kind in dict(COLUMNS, **{CONTENT_COLUMN: "string"}).items()
    }
    meta = {"version": MANIFEST_VERSION, "model": model, **(extra or {})}
    table = pa.table(arrays).replace_schema_metadata({META_KEY: json.dumps(meta, sort_keys=True)})
    target = Path(root) / MANIFEST_NAME
    try:
        with atomic_path(target) as tmp:
            pq.write_table(table, tmp)
    except OSError as exc:
        raise SeqkvError(f"cannot write {target}: {exc.strerror}") from None
    return target


def _plain_shard_name(name) -> bool:
    return (
        isinstance(name, str)
        and name.endswith(".skv")
        and name not in (".skv",)
        and "/" not in name
        and "\\" not in name
        and not name.startswith(".")
        and all(32 <= ord(c) != 127 for c in name)
    )
