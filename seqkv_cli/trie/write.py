"""Writing trie archives: a new file from captures (compress), or one more segment (add)."""

from __future__ import annotations

import os
from pathlib import Path

from seqkv_cli.errors import SeqkvError
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
    trie, first_new, sources, ends, coder, canon, on_progress, archived=None, members=None
) -> SegmentBuild:
    from seqkv_cli.sequential.session_codecs import SessionCodec

    if isinstance(coder, SessionCodec):
        build = encode_model_segment(
            trie, first_new, sources, ends, coder, canon, on_progress, members or {}
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


def write_new(out: Path, build: SegmentBuild, coder, header_model: dict, meta: dict) -> int:
    """Write a one-segment trie archive to a temporary sibling of `out`; return its size.

    The caller verifies the temporary file and renames it over `out` (publish) or drops it.
    """
    from seqkv_cli.container import ContainerWriter

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
        return writer.finish(header).file_bytes


def staging(out: Path) -> Path:
    return out.with_name(f".{out.name}.staging")


def publish(out: Path) -> None:
    try:
        os.replace(staging(out), out)
    except OSError as exc:
        staging(out).unlink(missing_ok=True)
        raise SeqkvError(f"cannot write {out}: {exc.strerror}") from None


def discard(out: Path) -> None:
    staging(out).unlink(missing_ok=True)
