"""`compress` into a trie archive: shared prefixes stored once, every session verified."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from seqkv_cli.clock import created_utc
from seqkv_cli.container import ContainerWriter
from seqkv_cli.container.compact import write_compact
from seqkv_cli.errors import SeqkvError
from seqkv_cli.fsutil import discard_quietly, publish, staging_name
from seqkv_cli.trie import (
    SegmentBuild,
    Trie,
    archive_header,
    build_segment,
    choose_members,
    compact_form,
    place_sessions,
    segment_sections,
)


def compress_sources(
    sources,
    out: Path,
    coder,
    check: bool,
    model,
    on_progress,
    near_dup=False,
    layout: str = "auto",
    on_session=None,
    meta: dict | None = None,
):
    """A new trie archive at `out` from sources (capture files, in-memory captures or
    tokens only); `meta`: entries added to the header's `meta` (a full-layout file only).

    `layout`: "auto" (one session that qualifies: a compact file), "compact" or "trie"
    (`write_new`). `on_session(index, capture)`: each tokens-only source as
    the walk recomputed it (trie/encode.py), before the archive is verified and published."""
    from seqkv_cli.runtime.loading import LoadedModel, load_model
    from seqkv_cli.sequential.registry import capabilities
    from seqkv_cli.skv.identity import load_canonical, same_model, writer_version
    from seqkv_cli.skv.result import CompressResult

    seen, header_model = set(), None
    for src in sources:
        header_model = same_model(header_model, src, src.where)
        if src.session_id in seen:
            raise SeqkvError(f"two captures have session id '{src.session_id}' ({src.where})")
        seen.add(src.session_id)
    lm = canon = None
    if capabilities(coder).needs_canonical:
        lm = model if isinstance(model, LoadedModel) else load_model(model)
        canon, ident = load_canonical(lm, coder.numerics)
        if ident["fingerprint"] != header_model["fingerprint"]:
            raise SeqkvError(
                f"{sources[0].where} comes from a different model "
                f"({header_model['fingerprint'][:12]} vs the loaded {ident['fingerprint'][:12]}); "
                "pass --model with the capture's model"
            )
        header_model = ident
    members = {}
    if near_dup:
        if canon is None:
            raise SeqkvError("--near-dup needs a model-backed codec (seq or seq-fast)")
        members = choose_members(sources)
    trie = Trie()
    ends = place_sessions(trie, sources, members)
    build = build_segment(
        trie, 0, sources, ends, coder, canon, on_progress, members=members, on_session=on_session
    )
    meta = {
        **(meta or {}),
        "created": created_utc(),
        "writer": writer_version(),
    }
    # `.{out}.{host}-{pid}-{random}.staging`: unique to this run, so two compresses to the
    # same output never delete or publish each other's file; named after its writer, so a
    # later run deletes the ones whose writer died (SIGKILL leaves them behind)
    tmp = staging_name(out, ".staging")
    try:
        file_bytes, written = write_new(tmp, out, build, coder, header_model, meta, layout)
        if check:
            verify_against(tmp, sources, coder, lm)
        publish(tmp, out)
    except BaseException:
        discard_quietly(tmp)
        raise
    result = CompressResult(out, len(sources), sum(len(s.tokens) for s in sources))
    result.input_kv_bytes = sum(_kv_bytes(s.meta, len(s.tokens)) for s in sources)
    result.file_bytes, result.layout = file_bytes, written
    for kind in ("tokens", "residual", "kv", "surprisal"):
        if n := build.bytes_of(kind):
            result.part_bytes[kind] = n
    stored = [d for name, d in build.parts.items() if written == "trie" or name != "index"]
    if written == "trie":
        result.part_bytes["trie tables"] = len(build.parts["index"])
    result.part_bytes["header"] = file_bytes - sum(len(d) for d in stored)
    return result


def write_new(
    tmp: Path,
    out: Path,
    build: SegmentBuild,
    coder,
    header_model: dict,
    meta: dict,
    layout: str = "trie",
) -> tuple[int, str]:
    """Write a one-segment trie archive for `out` to its staging file `tmp`: its size and
    layout.

    ``layout="auto"`` writes a one-session segment as a compact file (format 1.2: no JSON
    header, no capture provenance) where it qualifies, ``"compact"`` insists on it, and
    ``"trie"`` always writes the full layout. The caller verifies `tmp` and publishes it as
    `out` or drops it.
    """
    if layout in ("auto", "compact"):
        form = compact_form(build, coder.get_config(), header_model)
        if not isinstance(form, str):
            return write_compact(tmp, *form), "compact"
        if layout == "compact":
            raise SeqkvError(f"{out} cannot be a compact single-session file: {form}")
    header = archive_header(coder.get_config(), header_model, meta)
    with ContainerWriter(tmp) as writer:
        for name, data in segment_sections(build, 1):
            writer.add_section(name, data)
        return writer.finish(header).file_bytes, "trie"


def verify_against(path: Path, sources, coder, lm) -> None:
    """Restore every session of `path` and compare it with its capture; refuse on any miss."""
    from seqkv_cli.skv.restore import Archive
    from seqkv_cli.skv.verify import check_restored

    by_id = {s.session_id: s for s in sources}
    with Archive(path, model=lm) as arc:
        for entry, restored in arc.restore_many(arc.sessions):
            if isinstance(restored, Exception):
                raise SeqkvError(f"verification failed, nothing written: {restored}")
            src = by_id[entry["id"]]
            if src.recompute:  # K/V are the canonical recompute by definition: tokens decide
                if not np.array_equal(restored.tokens.numpy(), src.tokens):
                    raise SeqkvError(
                        f"verification failed, nothing written: session {src.session_id!r} "
                        "restores other tokens than it was given"
                    )
                continue
            check_restored(src.load(), restored, src.coder_for(coder), "nothing written")


def _kv_bytes(meta: dict, positions: int) -> int:
    size = {"bf16": 2, "fp16": 2, "fp32": 4}.get(meta.get("dtype"), 2)
    return (
        2
        * positions
        * size
        * int(meta["num_layers"])
        * int(meta["num_kv_heads"])
        * int(meta["head_dim"])
    )
