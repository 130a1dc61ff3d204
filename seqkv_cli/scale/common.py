"""What the serial and the Ray backends of the one pipeline (local.py) share: options,
results, tokenizing a row, the output directory's checks and the manifest step."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from seqkv_cli.errors import SeqkvError
from seqkv_cli.scale.plan import PREFIX_TOKENS, SHARD_SESSIONS, SHARD_TOKENS


@dataclass
class DatasetOptions:
    prefix_tokens: int = PREFIX_TOKENS
    shard_sessions: int = SHARD_SESSIONS
    shard_tokens: int = SHARD_TOKENS
    strict: bool = False  # refuse a session longer than the model context instead of skipping
    codec: str = "seq"
    numerics: str | None = None
    verify: bool = False

    def shard_options(self) -> dict:
        return {"codec": self.codec, "numerics": self.numerics, "verify": self.verify}


@dataclass
class Progress:
    """What a run has done so far (passed to `on_progress` after every shard)."""

    sessions: int = 0
    tokens: int = 0
    bytes: int = 0
    shards: int = 0
    skipped_shards: int = 0
    started: float = field(default_factory=time.monotonic)

    def line(self, total_shards: int) -> str:
        dt = max(time.monotonic() - self.started, 1e-9)
        return (
            f"{self.shards}/{total_shards} shards ({self.skipped_shards} already complete), "
            f"{self.sessions:,} sessions, {self.tokens:,} tokens, {self.bytes:,} bytes; "
            f"{self.sessions / dt:.1f} sessions/s, {self.tokens / dt:,.0f} tokens/s"
        )

    @classmethod
    def of(cls, counts: dict, started: float) -> Progress:
        """From the Ray counter actor's counts."""
        return cls(
            counts["sessions"],
            counts["tokens"],
            counts["bytes"],
            counts["shards"],
            counts["skipped"],
            started,
        )


@dataclass(frozen=True)
class TokenizedSession:
    """What the shard plan needs of one tokenized session (its token ids stay with the
    backend that tokenized it)."""

    where: str  # for messages: "file.jsonl:12", or the Ray rows' "dataset row"
    id: str
    tokens: int
    key: str  # the prefix key (plan.prefix_key)


@dataclass
class DatasetResult:
    root: Path
    manifest: Path
    sessions: int
    tokens: int
    file_bytes: int
    shards: int
    skipped_shards: int
    too_long: int  # sessions skipped as longer than the model context
    removed: list[str]  # shard files of an earlier plan, deleted
    seconds: float


def tokenize_row(lm, row, fits: ContextFilter | None = None) -> list[int] | None:
    """A dataset row's token ids (chat messages through the model's chat template).

    A text too long for the context is found before the tokenizer runs: with `fits` (not
    strict) it is skipped and counted like any session past the context (None); else its
    one-line refusal is raised."""
    from seqkv_cli.kvcapture.engine import SessionTooLong, tokenize
    from seqkv_cli.kvcapture.inputs import Document

    doc = Document(row.id, row.where, row.text, row.messages, row.token_ids)
    try:
        ids = tokenize(lm, doc)
    except SessionTooLong:
        if fits is None or fits.strict:
            raise
        fits.skipped += 1
        return None
    if not ids:
        raise SeqkvError(f"{row.where}: session {row.id!r} has no tokens")
    return ids


class ContextFilter:
    """Sessions longer than the model context: skipped and counted, or refused (`strict`)."""

    def __init__(self, context: int, strict: bool) -> None:
        self.context, self.strict, self.skipped = context, strict, 0

    def keep(self, where: str, session_id: str, n: int) -> bool:
        if n <= self.context:
            return True
        if self.strict:
            raise SeqkvError(
                f"{where}: session {session_id!r} has {n} tokens, more than the model context "
                f"({self.context}); without --strict such sessions are skipped and counted"
            )
        self.skipped += 1
        return False

    def nothing_left(self) -> SeqkvError:
        return SeqkvError(
            f"every session is longer than the model context ({self.skipped} skipped)"
        )


def prepare_output(root: Path, inputs: list[Path], fingerprint: str) -> list[Path]:
    """`root` is created, or is a directory this pipeline wrote for the same model: the
    directories this call created (a run that fails removes them if they stayed empty)."""
    from seqkv_cli.archive import fingerprint_matches, manifest_file, read_manifest
    from seqkv_cli.fsutil import make_output_dir

    root = Path(root)
    if root.exists() and not root.is_dir():
        raise SeqkvError(f"{root} is a file; a sharded archive is written to a directory")
    if root.suffix == ".skv":
        raise SeqkvError(f"{root}: a sharded archive is a directory; do not name it *.skv")
    for path in inputs:
        if Path(path).resolve() == root.resolve():
            raise SeqkvError(f"{root} is one of the inputs")
    created = make_output_dir(root)
    if manifest_file(root) is not None:
        old = read_manifest(root, check_shards=False)
        have = str(old.model.get("fingerprint", "?"))
        if not fingerprint_matches(have, fingerprint):
            raise SeqkvError(
                f"{root} holds shards of another model ({old.model.get('name', '?')}, "
                f"fingerprint {have[:16]}); write to another directory"
            )
    return created


def finish(root: Path, rows: list[dict], lm, plan_names: set[str], meta: dict):
    """Write the manifest and remove shard files of earlier plans; the result."""
    from seqkv_cli.archive import write_manifest, writer_version
    from seqkv_cli.fsutil import discard_quietly

    model = {"name": lm.name, "fingerprint": lm.fingerprint}
    manifest = write_manifest(root, rows, model, {"writer": writer_version(), **meta})
    from seqkv_cli.fsutil import clean_stale

    clean_stale(Path(root))  # what writers that died staged (a killed run, a lost actor)
    removed = []
    for stale in sorted(Path(root).glob("shard-*.skv")):
        if stale.name not in plan_names:
            discard_quietly(stale)
            removed.append(stale.name)
    file_bytes = sum((Path(root) / name).stat().st_size for name in plan_names)
    return manifest, removed, file_bytes
