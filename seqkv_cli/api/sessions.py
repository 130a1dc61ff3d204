"""`seqkv.compress_sessions`: many sessions given as token ids -> one `.skv` trie archive.

The batch form of `open_archive(...).add(id, input_ids)` without a cache: every session is
stored as its tokens (K/V come back from the canonical recompute on load), all in one trie
segment, so shared prefixes are stored once and no per-`add` segment framing is paid. The
sharded and Ray pipelines (seqkv_cli/scale) write each shard with it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from seqkv_cli.api.arguments import check_fits_context, check_session_id, token_list
from seqkv_cli.archive import compress_sources
from seqkv_cli.errors import SeqkvError
from seqkv_cli.kvcapture.engine import canonical_model, provenance
from seqkv_cli.runtime.loading import resolve_model
from seqkv_cli.runtime.numerics import DEFAULT
from seqkv_cli.sequential.registry import codec_capabilities, resolve_codec
from seqkv_cli.trie import Source

if TYPE_CHECKING:
    import torch

    from seqkv_cli.runtime.loading import LoadedModel


def compress_sessions(
    sessions: Iterable[tuple[str, object]],
    out: str | Path,
    model: str | Path | LoadedModel | torch.nn.Module | None = None,
    *,
    tokenizer: object = None,
    codec: str = "seq",
    numerics: str | None = None,
    verify: bool = False,
    layout: str = "auto",
    on_progress: Callable[[int], None] | None = None,
    file_meta: dict | None = None,
):
    """Write `sessions` ((id, input_ids) pairs, or a mapping id -> input_ids) to a new
    archive at `out` (atomically: a crash leaves no partial file); a CompressResult.

    `model` as for `open_archive` (also a LoadedModel); `codec` "seq" or "seq-fast";
    `verify` restores every session and compares its tokens before the file is published;
    `layout` as `seqkv compress --layout` (one session: a compact file by default);
    `file_meta`: JSON-plain entries for the header's `meta` (the shard pipeline records there
    what a shard holds: scale/shard.py)."""
    coder = session_codec(codec, numerics)
    lm = resolve_model(model, tokenizer=tokenizer)
    path = canonical_model(lm, coder.numerics).numeric_path
    base = provenance(lm, dtype="bf16", numeric_path=path, positions=0)
    base.pop("created")  # one time for the file (its header), not one per session
    items = sessions.items() if isinstance(sessions, dict) else sessions
    sources, seen = [], set()
    for item in items:
        try:
            raw_id, input_ids = item
        except (TypeError, ValueError):
            raise SeqkvError("sessions must be (id, input_ids) pairs or a mapping") from None
        sid = check_session_id(raw_id)
        if sid in seen:
            raise SeqkvError(f"session id {sid!r} is given twice; ids must be unique")
        seen.add(sid)
        ids = token_list(input_ids, lm.vocab_size)
        check_fits_context(sid, ids, lm)
        sources.append(Source.tokens_only(sid, ids, {**base, "positions": len(ids)}))
    if not sources:
        raise SeqkvError("no sessions to compress")
    return compress_sources(
        sources, Path(out), coder, verify, lm, on_progress, layout=layout, meta=file_meta
    )


def session_codec(codec: str = "seq", numerics: str | None = None):
    """The codec `compress_sessions` codes with (its config decides the bytes it writes)."""
    caps = codec_capabilities(str(codec))
    if caps is None or not (caps.needs_canonical and caps.trie_capable):
        raise SeqkvError(
            f"compress_sessions stores tokens for a model-backed trie codec (seq, seq-fast); "
            f"{codec!r} is not one"
        )
    return resolve_codec({"id": codec, "numerics": numerics or DEFAULT})
