"""Session datasets: JSONL and Parquet files with one session a row, read as a stream.

A row has an id and exactly one of `messages` (chat messages, rendered with the model's chat
template), `text`, or `token_ids`. Files are read a line (JSONL) or a record batch (Parquet)
at a time, so a dataset of millions of rows never sits in memory whole.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from seqkv_cli.errors import SeqkvError

DATASET_SUFFIXES = (".jsonl", ".parquet")
KINDS = ("messages", "text", "token_ids")
PARQUET_BATCH = 1024
MAX_ID_CHARS = 1024
# One session's bytes as read (a JSONL line, a text file, stdin): ~16 M tokens of text, past
# any model's context, and a bound on what is read before the model's own bound applies
# (kvcapture/engine.check_text_length runs before the tokenizer).
MAX_SESSION_BYTES = 64 << 20


@dataclass(frozen=True)
class Row:
    """One session of a dataset, as read: where it came from and its one payload."""

    id: str
    where: str  # "file.jsonl:12" or "file.parquet row 12", for messages
    messages: tuple[dict, ...] | None = None
    text: str | None = None
    token_ids: tuple[int, ...] | None = None


def is_dataset(path: Path) -> bool:
    return Path(path).suffix.lower() in DATASET_SUFFIXES


def iter_rows(path: Path, *, default_ids: bool = False) -> Iterator[Row]:
    """The rows of one dataset file, in order. `default_ids`: a row without an id is named
    `<file stem>-<row>` (what `seqkv capture` always did) instead of refused."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        yield from _jsonl_rows(path, default_ids)
    elif suffix == ".parquet":
        yield from _parquet_rows(path, default_ids)
    else:
        raise SeqkvError(f"{path} is not a session dataset (expected .jsonl or .parquet)")


def iter_dataset(paths: list[Path], *, default_ids: bool = False) -> Iterator[Row]:
    for path in paths:
        yield from iter_rows(path, default_ids=default_ids)


def check_ids(paths: list[Path]) -> int:
    """Read every row once and refuse a missing, malformed or repeated id (naming the row)
    before any model work; the number of rows. Memory: 8 bytes a row (a digest of each id)."""
    seen: dict[bytes, str] = {}
    count = 0
    for row in iter_dataset(paths):
        digest = hashlib.blake2b(row.id.encode("utf-8", "surrogatepass"), digest_size=8).digest()
        if digest in seen:
            raise SeqkvError(
                f"{row.where}: session id {row.id[:80]!r} appears twice (first at {seen[digest]}); "
                "ids must be unique"
            )
        seen[digest] = row.where
        count += 1
    if count == 0:
        raise SeqkvError(f"empty input: {', '.join(map(str, paths))} hold no sessions")
    return count


def row_from_mapping(obj: object, where: str, default_id: str | None = None) -> Row:
    """Check one row (a JSON object or a Parquet record) and return it as a Row."""
    if not isinstance(obj, dict):
        raise SeqkvError(f'{where}: expected an object like {{"id": ..., "text": ...}}')
    raw_id = obj.get("id")
    if raw_id is None:
        if default_id is None:
            raise SeqkvError(f"{where}: the row has no id (an `id` column is required)")
        raw_id = default_id
    if isinstance(raw_id, bool) or not isinstance(raw_id, str | int):
        raise SeqkvError(f"{where}: id must be a string or an integer, not {type(raw_id).__name__}")
    session_id = str(raw_id)
    if not session_id or len(session_id) > MAX_ID_CHARS:
        raise SeqkvError(f"{where}: id must have 1 to {MAX_ID_CHARS} characters")
    if any(ord(c) < 32 or ord(c) == 127 for c in session_id):
        raise SeqkvError(f"{where}: id {session_id[:40]!r} has control characters")
    present = [k for k in KINDS if obj.get(k) is not None]
    if len(present) != 1:
        raise SeqkvError(
            f"{where}: a row needs exactly one of {', '.join(KINDS)}"
            + (f" (it has {', '.join(present)})" if present else "")
        )
    kind = present[0]
    value = obj[kind]
    if kind == "text":
        if not isinstance(value, str) or not value.strip():
            raise SeqkvError(f"{where}: text must be a non-empty string")
        return Row(session_id, where, text=value)
    if kind == "token_ids":
        if (
            not isinstance(value, list | tuple)
            or not value
            or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)
        ):
            raise SeqkvError(f"{where}: token_ids must be a non-empty list of integers >= 0")
        return Row(session_id, where, token_ids=tuple(value))
    if not isinstance(value, list | tuple) or not value:
        raise SeqkvError(f"{where}: messages must be a non-empty list")
    for m in value:
        if not (
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
        ):
            raise SeqkvError(f'{where}: each message needs string "role" and "content"')
    return Row(
        session_id,
        where,
        messages=tuple({"role": m["role"], "content": m["content"]} for m in value),
    )


def _jsonl_rows(path: Path, default_ids: bool) -> Iterator[Row]:
    try:
        handle = path.open("rb")
    except FileNotFoundError:
        raise SeqkvError(f"no such input file: {path}") from None
    except OSError as exc:
        raise SeqkvError(f"cannot read input {path}: {exc.strerror}") from None
    with handle:
        for lineno, raw in enumerate(iter(lambda: handle.readline(MAX_SESSION_BYTES + 1), b""), 1):
            where = f"{path}:{lineno}"
            if len(raw) > MAX_SESSION_BYTES:
                raise SeqkvError(
                    f"{where}: a row of more than {MAX_SESSION_BYTES >> 20} MiB; one session "
                    "that long is past any model's context: split it"
                )
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise SeqkvError(f"{where}: not UTF-8 text (byte {exc.start})") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise SeqkvError(f"{where}: malformed JSON ({exc.msg})") from None
            except RecursionError:
                raise SeqkvError(f"{where}: JSON nested too deeply") from None
            default = f"{path.stem}-{lineno}" if default_ids else None
            yield row_from_mapping(obj, where, default)


def _parquet_rows(path: Path, default_ids: bool) -> Iterator[Row]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        handle = pq.ParquetFile(path)
    except FileNotFoundError:
        raise SeqkvError(f"no such input file: {path}") from None
    except (OSError, pa.ArrowException) as exc:
        raise SeqkvError(f"{path} is not a readable Parquet file ({exc})") from None
    columns = [c for c in ("id", *KINDS) if c in handle.schema_arrow.names]
    if not any(c in columns for c in KINDS):
        raise SeqkvError(f"{path} has none of the columns {', '.join(KINDS)}")
    if "id" not in columns and not default_ids:
        raise SeqkvError(f"{path} has no `id` column")
    row_number = 0
    try:
        for batch in handle.iter_batches(batch_size=PARQUET_BATCH, columns=columns):
            for obj in batch.to_pylist():
                row_number += 1
                where = f"{path} row {row_number}"
                default = f"{path.stem}-{row_number}" if default_ids else None
                yield row_from_mapping(obj, where, default)
    except (OSError, pa.ArrowException) as exc:
        raise SeqkvError(f"{path}: cannot read row {row_number + 1} ({exc})") from None
