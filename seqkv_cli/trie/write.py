"""Writing trie archives: a new file from captures (compress), or one more segment (add)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from seqkv_cli.errors import SeqkvError
from seqkv_cli.fsutil import staging_name
from seqkv_cli.trie.encode import SegmentBuild, encode_model_segment, refuse_empty
from seqkv_cli.trie.plan import Trie, insertion_order
from seqkv_cli.trie.sources import Source
from seqkv_cli.trie.store import TRIE_VERSION, part_name
from seqkv_cli.trie.tables import encode_tables


def plan(trie: Trie, sources: list[Source], members=None) -> list[tuple[int, int]]:
    """Insert every session (shortest first); each one's (end node, end offset).

    Near-duplicate `members` (stored as edits) are not inserted: their path is only the
    prefix they share exactly; one that shares nothing is inserted after all (and dropped
    from `members`).
    """
    refuse_empty(sources)
    members = {} if members is None else members
    ends: list[tuple[int, int] | None] = [None] * len(sources)
    for i in insertion_order([len(s.tokens) for s in sources]):
        if i not in members:
            node, end, _ = trie.insert(sources[i].tokens, i)
            ends[i] = (node, end)
    for i in sorted(members):
        node, offset, matched = trie.longest_match(sources[i].tokens)
        if matched == 0:
            del members[i]
            node, end, _ = trie.insert(sources[i].tokens, i)
            ends[i] = (node, end)
        else:
            ends[i] = trie.normalise(node, offset)
    return ends


def build_segment(
    trie,
    first_new,
    sources,
    ends,
    coder,
    canon,
    on_progress,
    archived=None,
    members=None,
    on_session=None,
) -> SegmentBuild:
    from seqkv_cli.sequential.registry import capabilities

    if capabilities(coder).needs_canonical:
        refuse_out_of_vocab(sources, canon.vocab_size)
        build = encode_model_segment(
            trie, first_new, sources, ends, coder, canon, on_progress, members or {}, on_session
        )
    else:
        from seqkv_cli.trie.pervector import encode_pervector_segment

        build = encode_pervector_segment(
            trie, first_new, sources, ends, coder, on_progress, archived
        )
    build.parts["index"] = encode_tables(build.tables, first_new)
    return build


def segment_sections(build: SegmentBuild, segment: int) -> list[tuple[str, bytes]]:
    """The segment's parts as container sections, index first (empty parts are left out)."""
    order = ["index", *sorted(n for n in build.parts if n != "index")]
    return [(part_name(segment, n), build.parts[n]) for n in order if build.parts[n]]


def write_new(
    out: Path, build: SegmentBuild, coder, header_model: dict, meta: dict, layout: str = "trie"
) -> tuple[int, str]:
    """Write a one-segment trie archive to a temporary sibling of `out`: its size and layout.

    ``layout="auto"`` writes a one-session segment as a compact file (format 1.2, ~45 bytes
    of framing, no capture provenance) where it qualifies, ``"compact"`` insists on it, and
    ``"trie"`` always writes the full layout. The caller verifies the temporary file and
    renames it over `out` (publish) or drops it.
    """
    from seqkv_cli.container import ContainerWriter

    if layout in ("auto", "compact"):
        from seqkv_cli.container.compact import write_compact
        from seqkv_cli.trie.compact import compact_form

        form = compact_form(build, coder.get_config(), header_model)
        if not isinstance(form, str):
            return write_compact(staging(out), *form), "compact"
        if layout == "compact":
            raise SeqkvError(f"{out} cannot be a compact single-session file: {form}")
    header = {
        "pipeline": [coder.get_config()],
        "model": header_model,
        "sessions": [],
        "meta": meta,
        "trie": {"version": TRIE_VERSION},
    }
    with ContainerWriter(staging(out)) as writer:
        for name, data in segment_sections(build, 1):
            writer.add_section(name, data)
        return writer.finish(header).file_bytes, "trie"


def refuse_out_of_vocab(sources: list[Source], vocab: int) -> None:
    """The model embeds only ids below its vocabulary; refuse others before any model work."""
    for src in sources:
        if len(src.tokens) and (src.tokens.min() < 0 or src.tokens.max() >= vocab):
            raise SeqkvError(
                f"session {src.session_id}: token ids must lie in [0, {vocab}) for this model, "
                f"got {src.tokens.min()}..{src.tokens.max()}"
            )


# Staging files: `.{out}.{host}-{pid}-{random}.staging` (fsutil.staging_name). The name is
# unique to one run, so two compresses to the same output never delete or publish each
# other's file, and it names its writer, so a later run deletes the ones whose writer died
# (SIGKILL leaves them behind).
_STAGED: dict[tuple[str, int], Path] = {}
_SUFFIX = ".staging"


def staging(out: Path) -> Path:
    """This run's staging file for `out` (the same path from write_new to publish/discard)."""
    key = (os.path.abspath(out), threading.get_ident())
    if key not in _STAGED:
        _STAGED[key] = staging_name(Path(out), _SUFFIX)
    return _STAGED[key]


def publish(out: Path) -> None:
    """Rename this run's staging file over `out` and make the rename durable."""
    from seqkv_cli.fsutil import publish as publish_file

    tmp = _STAGED.pop((os.path.abspath(out), threading.get_ident()), None)
    if tmp is None:
        raise SeqkvError(f"cannot write {out}: nothing was staged for it")
    publish_file(tmp, out)


def discard(out: Path) -> None:
    """Delete this run's staging file; quietly, so the error that led here stays the one shown."""
    from seqkv_cli.fsutil import discard_quietly

    tmp = _STAGED.pop((os.path.abspath(out), threading.get_ident()), None)
    if tmp is not None:
        discard_quietly(tmp)
