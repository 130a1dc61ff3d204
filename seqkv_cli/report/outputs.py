"""Report files: JSON (documented schema), CSV, Parquet and Markdown, each written atomically."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from seqkv_cli.clock import created_utc
from seqkv_cli.errors import SeqkvError
from seqkv_cli.fsutil import checkpoint, discard_quietly, publish, staging_name
from seqkv_cli.report.aggregate import by_codec
from seqkv_cli.report.collect import Report
from seqkv_cli.report.gate import Failure, Thresholds
from seqkv_cli.report.row import PARTS
from seqkv_cli.report.table import flag, num, residual_cell

SCHEMA = "seqkv.report"
SCHEMA_VERSION = 1


class OutputSet:
    """Files written to temporaries beside their targets and renamed together on success.

    Readers never see half a file, and a report that fails while writing its outputs leaves
    none of them behind.
    """

    def __init__(self) -> None:
        self._pending: list[tuple[Path, Path]] = []

    def write(self, path: Path, write: Callable[[Path], None]) -> None:
        try:
            tmp = staging_name(path)
            self._pending.append((tmp, path))
            checkpoint("write", tmp)
            write(tmp)
        except OSError as exc:
            raise SeqkvError(f"cannot write {path}: {exc.strerror or exc}") from None

    def __enter__(self) -> OutputSet:
        return self

    def __exit__(self, exc_type, *_) -> None:
        try:
            while self._pending and exc_type is None:
                tmp, path = self._pending[0]
                publish(tmp, path)
                self._pending.pop(0)
        finally:  # a failure (or a publish that failed) leaves none of the rest staged
            for tmp, _path in self._pending:
                discard_quietly(tmp)
            self._pending.clear()


def document(report: Report, limits: Thresholds, failures: list[Failure]) -> dict:
    """The JSON document (schema in docs/REPORT.md)."""
    from seqkv_cli.version import __version__

    opts = report.options
    return {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "seqkv_version": __version__,
        "created": created_utc(),
        "options": {
            "codecs": opts.codecs,
            "verify": opts.verify,
            "continuation": opts.continuation,
            "window": opts.window,
        },
        "models": [
            {
                "name": g.name,
                "fingerprint": g.fingerprint,
                "captures": [str(c.path) for c in g.captures],
                "archives": [str(p) for p in g.archives],
            }
            for g in report.groups
        ],
        "notes": report.notes,
        "tries": report.tries,
        "sessions": [row.to_json() for row in report.rows],
        "gate": {
            "thresholds": limits.to_json(),
            "passed": not failures,
            "failures": [f.to_json() for f in failures],
        },
    }


def write_json(out: OutputSet, path: Path, doc: dict) -> None:
    text = json.dumps(doc, indent=2, allow_nan=False) + "\n"
    out.write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def frame(report: Report):
    """One row per session x codec, columns as in docs/REPORT.md (CSV and Parquet)."""
    import pandas as pd

    return pd.DataFrame([row.to_flat() for row in report.rows])


def write_csv(out: OutputSet, path: Path, report: Report) -> None:
    df = frame(report)
    out.write(path, lambda tmp: df.to_csv(tmp, index=False))


def write_parquet(out: OutputSet, path: Path, report: Report) -> None:
    df = frame(report)
    out.write(path, lambda tmp: df.to_parquet(tmp, index=False, engine="pyarrow"))


def markdown(report: Report, failures: list[Failure], limits: Thresholds) -> str:
    """A job summary: per-codec totals, per-session rows, the gate verdict, the notes."""
    lines = ["## seqkv report", ""]
    lines += _md_table(
        ["model", "codec", "source", "sessions", "positions", "bits/position", "log2 PP", "gap"]
        + [f"{p} b/pos" for p in PARTS]
        + ["restore s", "restore tokens/s"],
        [
            [s.model, s.codec, s.source, s.sessions, s.positions, num(s.bits_per_position)]
            + [num(s.log2_ppl), num(s.gap_ratio)]
            + [num(s.part_bits_per_position(p)) for p in PARTS]
            + [num(s.restore_seconds), num(s.restore_tokens_per_s)]
            for s in by_codec(report.rows)
        ],
    )
    lines += ["", "### Sessions", ""]
    lines += _md_table(SESSION_COLUMNS, [_session_cells(r) for r in report.rows])
    lines += ["", "### Gate", ""]
    if not limits.active:
        lines.append("No thresholds set.")
    elif not failures:
        lines.append(f"**passed** ({_limits_text(limits)})")
    else:
        lines.append(f"**failed** ({_limits_text(limits)}):")
        lines += [f"- `{f.id}` ({f.codec}, {f.source}): {f.reason}" for f in failures]
    if report.notes:
        lines += ["", "### Notes", ""] + [f"- {n}" for n in report.notes]
    return "\n".join(lines) + "\n"


SESSION_COLUMNS = [
    "session",
    "codec",
    "role",
    "positions",
    "bits/position",
    "log2 PP",
    "gap",
    "vs fp16",
    "vs turbo3",
    "exact",
    "max abs err",
    "attention err",
    "residual p95 K / V",
]


def _session_cells(r) -> list:
    return [
        r.id,
        r.codec,
        r.role,
        r.positions,
        *(num(x) for x in (r.bits_per_position, r.log2_ppl, r.gap_ratio)),
        *(num(x) for x in (r.ratio_vs_fp16, r.ratio_vs_turbo3)),
        flag(r.exact),
        num(r.max_abs_error),
        num(r.attention_error),
        residual_cell(r),
    ]


def write_markdown(out: OutputSet, path: Path, text: str) -> None:
    out.write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def _md_table(header: list[str], body: list[list]) -> list[str]:
    def cells(values) -> str:
        return "| " + " | ".join(str(v).replace("|", "\\|") for v in values) + " |"

    return [cells(header), "|" + "---|" * len(header)] + [cells(r) for r in body]


def _limits_text(limits: Thresholds) -> str:
    parts = []
    if limits.max_bits_per_position is not None:
        parts.append(f"bits/position <= {limits.max_bits_per_position:g}")
    if limits.max_gap is not None:
        parts.append(f"gap <= {limits.max_gap:g}")
    if limits.require_exact:
        parts.append("bit-exact")
    return ", ".join(parts)
