"""Rows of a report: every session of every input, for every codec asked for.

A `.skv` input gives one row per session for its own codec. Captures give one row per session
for each codec of `--codecs`, computed by compressing them into a temporary `.skv` with the
same code as `seqkv compress` and accounting it as if it were an input, so that computed and
file rows are measured alike. Fidelity compares what a container restores with the capture of
the same session (same model fingerprint, same id).
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from seqkv_cli.errors import SeqkvError
from seqkv_cli.report.inputs import CaptureRef, ModelGroup, group_inputs
from seqkv_cli.report.measure import Continuations, attach_windows, measure_fidelity
from seqkv_cli.report.models import ModelResolver
from seqkv_cli.report.quanto import QUANTO_CODECS, quantize_capture, quanto_available, quanto_row
from seqkv_cli.report.row import Row, row_from_entry

DEFAULT_CODECS = ("seq", "seq-fast", "int8", "turbo3", "hf-quanto4")


@dataclass
class ReportOptions:
    codecs: list[str] | None = None  # None: DEFAULT_CODECS, shown as baselines
    # the models to try, each for the groups whose fingerprint it has (None: the one each
    # capture names)
    model: str | list[str] | None = None
    verify: bool = True  # decode and compare with the captures
    continuation: int = 0  # greedy tokens for ppl change / agreement; 0 = off
    window: int = 64  # positions per marginal-cost window


@dataclass
class Report:
    rows: list[Row]
    groups: list[ModelGroup]
    notes: list[str] = field(default_factory=list)
    options: ReportOptions = field(default_factory=ReportOptions)
    tries: list[dict] = field(default_factory=list)  # one per trie archive (PLT metric)


def check_codecs(names: list[str]) -> list[str]:
    """Known codec ids, deduplicated in order; an unknown one lists the valid ids."""
    from seqkv_cli.sequential.registry import codec_ids

    valid = {*codec_ids(), *QUANTO_CODECS}
    for name in names:
        if name not in valid:
            raise SeqkvError(f"unknown codec id {name!r}; available: {', '.join(sorted(valid))}")
    return list(dict.fromkeys(names))


def check_options(codecs: list[str] | None, continuation: int, window: int) -> None:
    """Refuse bad report options before any input or output file is looked at."""
    if codecs is not None:
        if not codecs:
            raise SeqkvError("--codecs is empty; name at least one codec (`seqkv codecs`)")
        check_codecs(codecs)
    if continuation < 0 or window < 1:
        raise SeqkvError(
            f"--continuation must be >= 0 and --window >= 1, got {continuation}, {window}"
        )


def report(
    inputs,
    *,
    codecs: list[str] | None = None,
    model: str | list[str] | None = None,
    verify: bool = True,
    continuation: int = 0,
    window: int = 64,
    progress: Callable[[str], None] | None = None,
) -> Report:
    """`seqkv report` as a function: rows (bits/position, log2 PP, exactness, ...) for capture
    files, `.skv` files and folders of them; `codecs` None reports the default baselines."""
    check_options(codecs, continuation, window)
    paths = [Path(inputs)] if isinstance(inputs, str | Path) else [Path(p) for p in inputs]
    options = ReportOptions(codecs, model, verify, continuation, window)
    return build_report(paths, options, progress)


def build_report(
    inputs: list[Path], options: ReportOptions, progress: Callable[[str], None] | None = None
) -> Report:
    """Collect every row; raises SeqkvError for bad input before any heavy work where it can."""
    codecs = check_codecs(options.codecs) if options.codecs else list(DEFAULT_CODECS)
    groups = group_inputs(inputs)
    notes: list[str] = []
    if len(groups) > 1:
        names = ", ".join(f"{g.name} ({g.fingerprint[:12]})" for g in groups)
        notes.append(f"inputs come from {len(groups)} models: {names}; rows are grouped by model")
    collector = _Collector(options, notes, progress or (lambda _: None))
    any_archive = any(g.archives for g in groups)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="seqkv-report-") as tmp:
        for index, group in enumerate(groups):
            rows += collector.group_rows(group, codecs, any_archive, Path(tmp) / f"g{index}")
    return Report(rows, groups, notes, options, collector.tries)


class _Collector:
    def __init__(self, options: ReportOptions, notes: list[str], progress) -> None:
        self.options, self.notes, self.say = options, notes, progress
        self.models = ModelResolver(options.model, notes, progress)
        self.tries: list[dict] = []
        self.continuations = Continuations(options.continuation)
        self._surprisal: dict[Path, np.ndarray] = {}

    def group_rows(self, group: ModelGroup, codecs, any_archive: bool, tmp: Path) -> list[Row]:
        explicit = self.options.codecs is not None
        rows: list[Row] = []
        for path in group.archives:
            rows += self.archive_rows(path, group, "subject", str(path))
        have = {(r.id, r.codec) for r in rows}
        for codec in codecs:
            caps = [c for c in group.captures if (c.session_id, codec) not in have]
            if not caps:
                continue
            under_test = explicit or (codec == "seq" and not any_archive)
            role = "subject" if under_test else "baseline"
            if codec in QUANTO_CODECS:
                rows += self.quanto_rows(group, codec, role, caps)
                continue
            rows += self.computed_rows(group, codec, role, caps, tmp, explicit)
        return rows

    def computed_rows(self, group, codec, role, caps, tmp: Path, explicit: bool) -> list[Row]:
        from seqkv_cli.archive import compress_captures
        from seqkv_cli.sequential.registry import session_codec_class

        lm = None
        if session_codec_class(codec) is not None:
            lm = self.models.for_group(group, f"compute {codec}", required=explicit)
            if lm is None:
                return []
        tmp.mkdir(parents=True, exist_ok=True)
        out = tmp / f"{codec}.skv"
        self.say(f"{group.name}: compressing {len(caps)} session(s) with {codec}")
        compress_captures([c.path for c in caps], out, codec=codec, model=lm, check=False)
        return self.archive_rows(out, group, role, "computed", lm)

    def archive_rows(self, path: Path, group, role: str, source: str, lm=None) -> list[Row]:
        from seqkv_cli.archive import Archive, account

        with Archive(path) as arc:
            needs_model, sessions = arc.needs_model, [e["id"] for e in arc.sessions]
        checkable = self.options.verify and any(group.capture_of(s) for s in sessions)
        if needs_model and lm is None and checkable:
            lm = self.models.for_group(group, f"decode {Path(source).name} to verify it")
        with Archive(path, model=lm) as arc:
            accounts = account(arc).sessions
            if arc.trie is not None and role != "baseline":
                self._trie(arc, path, source)
            rows = [
                row_from_entry(arc, e, a, group, role, source)
                for e, a in zip(arc.sessions, accounts, strict=True)
            ]
            by_id = {r.id: r for r in rows}
            todo = [e for e in arc.sessions if group.capture_of(e["id"])]
            if checkable and todo and (lm is not None or not needs_model):
                self.say(f"{group.name}: decoding {len(todo)} session(s) of {path.name}")
                if arc.needs_model:
                    arc.canonical()  # model set-up is not restore time
                start, busy, decoded = time.perf_counter(), 0.0, 0
                for entry, restored in arc.restore_many(todo):
                    if isinstance(restored, Exception):
                        raise restored
                    row = by_id[entry["id"]]
                    row.restore_seconds = time.perf_counter() - start - busy
                    row.residual_p95 = restored.residual_p95
                    decoded += row.positions
                    measuring = time.perf_counter()
                    self._fidelity(row, group, restored, lm, source)
                    busy += time.perf_counter() - measuring  # comparing is not restoring
                rate = decoded / max(time.perf_counter() - start - busy, 1e-9)
                for entry in todo:
                    by_id[entry["id"]].restore_tokens_per_s = rate
            for entry, row in zip(arc.sessions, rows, strict=True):
                ref = group.capture_of(row.id)
                self._windows(row, ref, entry.get("token_bits_ideal"))
        return rows

    def _trie(self, arc, path: Path, source: str) -> None:
        """The trie's shape and what sharing saved (coverage, PLT bits: `trie.trie_shape`)."""
        from seqkv_cli.trie import trie_shape

        shape = trie_shape(arc)
        positions = max(sum(e["positions"] for e in arc.sessions), 1)
        name = Path(source).name if source != "computed" else f"{arc.codec.codec_id} (computed)"
        self.tries.append({"archive": name, "codec": arc.codec.codec_id, **shape})
        self.notes.append(
            f"{name}: trie of {shape['nodes']} nodes ({shape['roots']} roots, depth "
            f"{shape['depth']}, {shape['segments']} segment(s)); {shape['coverage']:.0%} of "
            f"sessions share a prefix with another; sharing saves {shape['saved_bytes']:,.0f} "
            f"bytes ({shape['saved_bytes'] * 8 / positions:.2f} bits/position)"
        )

    def quanto_rows(self, group, codec: str, role: str, caps) -> list[Row]:
        if not quanto_available():
            note = f"{codec} skipped: optimum-quanto is not installed (pip install 'seqkv[quanto]')"
            if note not in self.notes:
                self.notes.append(note)
            return []
        from seqkv_cli.kvcapture.capture_file import load_capture

        rows = []
        self.say(f"{group.name}: {codec} (transformers QuantizedCache) on {len(caps)} session(s)")
        for ref in caps:
            original = load_capture(ref.path)
            restored, bits = quantize_capture(original, QUANTO_CODECS[codec])
            row = quanto_row(ref.session_id, original, group, codec, role, bits)
            if self.options.verify:
                self._fidelity(row, group, restored, None, row.source, original)
            self._windows(row, ref, None)
            rows.append(row)
        return rows

    def _fidelity(self, row: Row, group, restored, lm, where: str, original=None) -> None:
        from seqkv_cli.kvcapture.capture_file import load_capture

        if original is None:
            original = load_capture(group.capture_of(row.id).path)
        measure_fidelity(row, original, restored, where)
        if self.options.continuation and not row.exact:
            lm = lm or self.models.for_group(group, "measure ppl change / greedy agreement")
        self.continuations.apply(row, lm, original, restored)

    def _windows(self, row: Row, ref: CaptureRef | None, token_bits_ideal) -> None:
        """Windows of marginal cost; log2 PP from the capture itself when there is one (a
        container header may store it rounded)."""
        surprisal = self._surprisal_of(ref) if ref is not None else None
        if surprisal is not None and len(surprisal) == row.positions - 1 > 0:
            row.log2_ppl = float(surprisal.mean())
        first = None
        if token_bits_ideal is not None and surprisal is not None:
            first = float(token_bits_ideal) - float(surprisal.sum())
        attach_windows(row, surprisal, self.options.window, first)

    def _surprisal_of(self, ref: CaptureRef) -> np.ndarray:
        """A capture's surprisal without loading its K/V (safetensors reads one tensor)."""
        if ref.path not in self._surprisal:
            from safetensors import safe_open

            with safe_open(str(ref.path), framework="np") as f:
                self._surprisal[ref.path] = f.get_tensor("surprisal").astype(np.float64)
        return self._surprisal[ref.path]
