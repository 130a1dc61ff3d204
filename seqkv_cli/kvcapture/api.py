"""`seqkv_cli.capture(...)`: the Python API that the `seqkv capture` command mirrors."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from seqkv_cli.errors import SeqkvError
from seqkv_cli.fsutil import ensure_writable_dir, refuse_output_in_inputs
from seqkv_cli.kvcapture.capture_file import DTYPES, Capture, save_capture
from seqkv_cli.kvcapture.engine import run_capture, tokenize
from seqkv_cli.kvcapture.inputs import Document, read_inputs, unique_stems

if TYPE_CHECKING:
    from seqkv_cli.runtime.loading import LoadedModel


@dataclass
class CaptureResult:
    document: Document
    capture: Capture
    path: Path | None
    bytes_written: int


@dataclass
class Plan:
    """Documents tokenized and checked against the context before any model work starts."""

    documents: list[Document]
    token_ids: list[list[int]]

    @property
    def total_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)


def plan_capture(
    lm: LoadedModel,
    documents: list[Document],
    *,
    max_tokens: int | None = None,
    truncate: bool = False,
) -> Plan:
    if max_tokens is not None and max_tokens < 1:
        raise SeqkvError(f"--max-tokens must be at least 1, got {max_tokens}")
    token_ids = []
    for doc in documents:
        ids = tokenize(lm, doc)
        if not ids:
            raise SeqkvError(f"empty input: {doc.source} has no tokens")
        if max_tokens is not None:
            ids = ids[:max_tokens]
        if len(ids) > lm.max_context:
            if not truncate:
                raise SeqkvError(
                    f"{doc.source} has {len(ids)} tokens, more than the model context "
                    f"({lm.max_context}); pass --truncate to keep the first {lm.max_context}"
                )
            ids = ids[: lm.max_context]
        token_ids.append(ids)
    return Plan(documents, token_ids)


def output_paths(out: Path, documents: list[Document]) -> list[Path]:
    """One file when `out` ends in .safetensors (single session), else a directory of files."""
    out = Path(out)
    if out.suffix == ".safetensors":
        if len(documents) != 1:
            raise SeqkvError(
                f"{len(documents)} sessions cannot go into one file {out}; give a directory instead"
            )
        targets, folder = [out], out.parent
    else:
        stems = unique_stems([d.id for d in documents])  # refuses ids sharing a file name
        targets, folder = [out / f"{stems[d.id]}.safetensors" for d in documents], out
    ensure_writable_dir(folder)
    return targets


def input_files(inputs: list[str]) -> list[Path]:
    """The files `read_inputs` reads (a directory's files, not the directory itself)."""
    files = []
    for raw in inputs:
        path = Path(raw)
        if raw == "-":
            continue
        if path.is_dir():
            files.extend(p for p in path.iterdir() if p.is_file())
        else:
            files.append(path)
    return files


def prepare_capture(
    inputs: Sequence[str] | str,
    *,
    model: str | LoadedModel | None = None,
    out: Path | str | None = None,
    dtype: str = "bf16",
    max_tokens: int | None = None,
    truncate: bool = False,
    progress: Callable[[str], None] | None = None,
) -> tuple[object, Plan, list[Path | None]]:
    """Validate everything (inputs, output, model, lengths) before any forward pass runs."""
    from seqkv_cli.runtime.loading import LoadedModel, load_model

    if dtype not in DTYPES:
        raise SeqkvError(f"unknown dtype '{dtype}'; choose one of {', '.join(DTYPES)}")
    documents = read_inputs([inputs] if isinstance(inputs, str) else list(inputs))
    targets = output_paths(Path(out), documents) if out is not None else [None] * len(documents)
    inputs_read = input_files([inputs] if isinstance(inputs, str) else list(inputs))
    for target in targets:
        if target is not None:
            refuse_output_in_inputs(target, inputs_read)
    lm = model if isinstance(model, LoadedModel) else load_model(model, progress=progress)
    plan = plan_capture(lm, documents, max_tokens=max_tokens, truncate=truncate)
    return lm, plan, targets


def capture_one(
    lm: LoadedModel,
    doc: Document,
    ids: list[int],
    target: Path | None,
    *,
    dtype: str,
    canonical: bool,
    on_progress: Callable[[int], None] | None = None,
    numerics: str | None = None,
) -> CaptureResult:
    cap = run_capture(
        lm, ids, dtype=dtype, canonical=canonical, on_progress=on_progress, numerics=numerics
    )
    cap.meta.update({"session_id": doc.id, "source": doc.source})
    written = save_capture(cap, target) if target is not None else 0
    return CaptureResult(doc, cap, target, written)


def capture_planned(
    lm: LoadedModel,
    plan: Plan,
    targets: list[Path | None],
    *,
    dtype: str,
    canonical: bool,
    numerics: str | None = None,
    on_progress: Callable[[int], None] | None = None,
    on_start: Callable[[Document], None] | None = None,
) -> Iterator[CaptureResult]:
    """Capture `plan`'s sessions in order, each written to its target (if any) and yielded
    as it is done; `on_start(document)` is told before each session runs."""
    for doc, ids, target in zip(plan.documents, plan.token_ids, targets, strict=True):
        if on_start is not None:
            on_start(doc)
        yield capture_one(
            lm,
            doc,
            ids,
            target,
            dtype=dtype,
            canonical=canonical,
            on_progress=on_progress,
            numerics=numerics,
        )


def capture(
    inputs: Sequence[str] | str,
    *,
    model: str | LoadedModel | None = None,
    out: Path | str | None = None,
    dtype: str = "bf16",
    canonical: bool = True,
    max_tokens: int | None = None,
    truncate: bool = False,
    on_progress: Callable[[int], None] | None = None,
    numerics: str | None = None,
) -> list[CaptureResult]:
    """Capture K/V of every input session; write files when `out` is given.

    `model` is a `LoadedModel`, a spec string for `load_model`, or None for the embedded default.
    """
    lm, plan, targets = prepare_capture(
        inputs, model=model, out=out, dtype=dtype, max_tokens=max_tokens, truncate=truncate
    )
    return list(
        capture_planned(
            lm,
            plan,
            targets,
            dtype=dtype,
            canonical=canonical,
            numerics=numerics,
            on_progress=on_progress,
        )
    )
