"""A directory of shard archives read as one logical archive, through its manifest.

`manifest.parquet` (written last, atomically, by the sharded and Ray pipelines) has one row
per session: its id, the shard file that holds it, tokens, own bytes, shared prefix, log2 PP
and the prefix key that placed it. Its schema metadata names the model every shard must be
of. docs/FORMAT.md, "Shard manifests", specifies it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from seqkv_cli.errors import SeqkvError

MANIFEST_NAME = "manifest.parquet"
MANIFEST_VERSION = 1
META_KEY = b"seqkv_manifest"
COLUMNS = {
    "session_id": "string",
    "shard": "string",
    "tokens": "int64",
    "bytes": "int64",
    "shared_prefix": "int64",
    "log2_pp": "float64",
    "prefix_key": "string",
}


@dataclass
class Manifest:
    """A read manifest: its directory, the model it names, and its rows (a DataFrame)."""

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
    _check_schema(file, table)
    rows = table.select(list(COLUMNS)).to_pandas()
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


def _check_schema(file: Path, table) -> None:
    """Every column there, of its type, with no empty cells (log2 PP may be unknown), and
    counts that can be counts: checked on whole columns, not row by row."""
    import pyarrow as pa
    import pyarrow.compute as pc

    missing = [c for c in COLUMNS if c not in table.column_names]
    if missing:
        raise SeqkvError(f"{file}: manifest lacks the column(s) {', '.join(missing)}")
    allowed = {"string": (pa.string(), pa.large_string()), "int64": (pa.int64(),)}
    allowed["float64"] = (pa.float64(),)
    for name, kind in COLUMNS.items():
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


def _check_against_shards(file: Path, manifest: Manifest, fingerprint: str) -> None:
    """Each shard is there, of the manifest's model, and holds exactly the sessions the
    manifest lists for it with the token counts it gives (read from the shards' headers).
    Bytes and shared prefixes are what the writer measured; `archive list` says so."""
    import pandas as pd

    from seqkv_cli.skv.identity import fingerprint_matches
    from seqkv_cli.skv.restore import Archive

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
            held += [(shard.name, e["id"], e["positions"]) for e in arc.sessions]
        if not fingerprint_matches(got, fingerprint):
            raise SeqkvError(
                f"{shard} holds sessions of another model (fingerprint {got[:16]}) than "
                f"{file} names ({fingerprint[:16]}); one manifest holds one model"
            )
    shards = pd.DataFrame(held, columns=["shard", "session_id", "positions"])
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


def write_manifest(root: Path, rows: list[dict], model: dict, extra: dict | None = None) -> Path:
    """Write `root/manifest.parquet` atomically (`fsutil.publish`)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from seqkv_cli.fsutil import atomic_path

    ordered = sorted(rows, key=lambda r: (r["shard"], r["session_id"]))
    arrays = {
        name: pa.array([r[name] for r in ordered], type=getattr(pa, kind)())
        for name, kind in COLUMNS.items()
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
