"""Capture and `seq`-code many sessions in one walk of the model (what `seqkv pipeline` runs).

A canonical capture of a session is, by definition, what the canonical forward computes for
its tokens, and that is exactly what the `seq` encoder's trie walk computes to code them
(trie/encode.py): so one walk does both. Sessions go in as their token ids (tokens-only
sources), each shared prefix is run once, and every session's K/V and surprisal, as the walk
recomputed them, are written as the capture file `seqkv capture` would write (the same tensors,
bit for bit: the portable forward gives the same bits however a sequence is cut).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from seqkv_cli.kvcapture.api import CaptureResult, Plan
from seqkv_cli.kvcapture.capture_file import save_capture
from seqkv_cli.skv.result import CompressResult


def capture_and_code(
    lm,
    plan: Plan,
    targets: list[Path],
    out: Path,
    *,
    dtype: str,
    numerics: str | None = None,
    on_progress: Callable[[int], None] | None = None,
) -> tuple[CompressResult, list[CaptureResult]]:
    """Write `plan`'s sessions as captures at `targets` and as a `seq` archive at `out`, on
    the canonical path `numerics` (None: the default, as `seqkv capture`)."""
    from seqkv_cli.kvcapture.engine import canonical_model, provenance
    from seqkv_cli.sequential.registry import resolve_codec
    from seqkv_cli.skv.compress_trie import compress_sources
    from seqkv_cli.trie import Source

    path = canonical_model(lm, numerics).numeric_path

    def meta(doc, ids) -> dict:  # what capture_one writes (session_id comes with the source)
        made = provenance(lm, dtype=dtype, numeric_path=path, positions=len(ids))
        return {**made, "source": doc.source}

    sources = [
        Source.tokens_only(doc.id, ids, meta(doc, ids))
        for doc, ids in zip(plan.documents, plan.token_ids, strict=True)
    ]
    captures: dict[int, CaptureResult] = {}

    def write_capture(index: int, cap) -> None:
        written = save_capture(cap, targets[index])
        captures[index] = CaptureResult(plan.documents[index], cap, targets[index], written)

    coder = resolve_codec({"id": "seq", "numerics": path})
    result = compress_sources(
        sources, Path(out), coder, False, lm, on_progress, on_session=write_capture
    )
    return result, [captures[i] for i in range(len(sources))]
