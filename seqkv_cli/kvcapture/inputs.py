"""Inputs to capture: text files, stdin, and session datasets (JSONL or Parquet, one session a
row: chat messages, text or token ids; kvcapture/rows.py), one capture per session."""

from __future__ import annotations

import hashlib
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from seqkv_cli.errors import SeqkvError
from seqkv_cli.kvcapture.rows import MAX_SESSION_BYTES, is_dataset, iter_rows

_SAFE_ID = re.compile(r"[^A-Za-z0-9._-]+")
MAX_STEM = 120  # bytes; names stay well under the 255-byte limit with suffix and temp prefix


def file_stem_for(session_id: str) -> str:
    """The file name stem of a session: the id itself when it is a short, safe name;
    otherwise its safe characters plus a hash of the whole id, so that ids which sanitise
    alike ("a b" and "a_b", "x/y" and "x_y", "." and "..") never share a file."""
    stem = _SAFE_ID.sub("_", session_id).strip("._")
    if stem == session_id and 0 < len(stem) <= MAX_STEM:
        return stem
    digest = hashlib.sha256(session_id.encode("utf-8", "surrogatepass")).hexdigest()[:10]
    return f"{stem[: MAX_STEM - 11] or 'session'}-{digest}"


def unique_stems(session_ids: list[str]) -> dict[str, str]:
    """Each id's file stem; refuse two ids whose files would be one (names compared without
    case: macOS and Windows file systems do not tell "A" from "a")."""
    stems: dict[str, str] = {}
    owner: dict[str, str] = {}
    for session_id in session_ids:
        stem = file_stem_for(session_id)
        other = owner.setdefault(stem.casefold(), session_id)
        if other != session_id:
            raise SeqkvError(
                f"sessions {other!r} and {session_id!r} would both be written to "
                f"{stem}.safetensors; rename one of them"
            )
        stems[session_id] = stem
    return stems


@dataclass(frozen=True)
class Document:
    """One session to capture: plain text, or chat messages rendered with the chat template."""

    id: str
    source: str
    text: str | None = None
    messages: tuple[dict, ...] | None = None
    token_ids: tuple[int, ...] | None = None  # already tokenized: used as they are

    @property
    def file_stem(self) -> str:
        return file_stem_for(self.id)


def read_inputs(paths: list[str]) -> list[Document]:
    """Expand files, directories (their files but README, sorted) and `-` (stdin) into documents."""
    if not paths:
        raise SeqkvError("no inputs given")
    docs: list[Document] = []
    for raw in paths:
        if raw == "-":
            docs.append(_text_doc("stdin", "<stdin>", _bounded_read(sys.stdin, "<stdin>")))
            continue
        path = Path(raw)
        if path.is_dir():
            # A directory's README describes its inputs; it is not one of them.
            files = sorted(
                p
                for p in path.iterdir()
                if p.is_file() and not p.name.startswith(".") and p.stem.upper() != "README"
            )
            if not files:
                raise SeqkvError(f"empty input: directory {raw} holds no files")
            for f in files:
                docs.extend(_read_file(f))
        else:
            docs.extend(_read_file(path))
    seen: set[str] = set()
    for d in docs:
        if d.id in seen:
            raise SeqkvError(f"two inputs have the same session id '{d.id}'; ids must be unique")
        seen.add(d.id)
    return docs


def _read_file(path: Path) -> list[Document]:
    if is_dataset(path):
        return _read_sessions(path)
    try:
        with path.open("rb") as handle:
            data = _bounded_read(handle, str(path))
    except FileNotFoundError:
        raise SeqkvError(f"no such input file: {path}") from None
    except OSError as exc:
        raise SeqkvError(f"cannot read input {path}: {exc.strerror}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SeqkvError(f"{path} is not UTF-8 text (byte {exc.start})") from None
    return [_text_doc(path.stem, str(path), text)]


def _bounded_read(handle, name: str):
    """All of `handle`, refused in one line past MAX_SESSION_BYTES (characters, for text)."""
    data = handle.read(MAX_SESSION_BYTES + 1)
    if len(data) > MAX_SESSION_BYTES:
        raise SeqkvError(
            f"{name}: more than {MAX_SESSION_BYTES >> 20} MiB; one session that long is past "
            "any model's context: split it"
        )
    return data


def _text_doc(doc_id: str, source: str, text: str) -> Document:
    if not text.strip():
        raise SeqkvError(f"empty input: {source}")
    return Document(id=doc_id, source=source, text=text)


def _read_sessions(path: Path) -> list[Document]:
    docs = [
        Document(
            id=row.id,
            source=row.where,
            text=row.text,
            messages=row.messages,
            token_ids=row.token_ids,
        )
        for row in iter_rows(path, default_ids=True)
    ]
    if not docs:
        raise SeqkvError(f"empty input: {path} holds no sessions")
    return docs
