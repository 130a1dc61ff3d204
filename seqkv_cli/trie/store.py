"""A trie archive on disk: segments of node/session tables, token streams and K/V blocks.

Each commit (compress, or one `archive add`) writes one segment ``t<k>/``:
``t<k>/index`` (binary tables, tables.py), ``t<k>/tokens`` (the segment's token payloads; after
the table in ``t<k>/index`` where the table is version 2),
``t<k>/kv`` and ``t<k>/surprisal`` (per-vector codecs only) and, only where a session's own
K/V is not what the trie reproduces, ``t<k>/s<j>/residual.layers.<i>.<key|value>``. Nodes and
sessions are numbered across segments in commit order, so a later segment may branch off any
earlier node without touching it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from seqkv_cli.errors import SeqkvError
from seqkv_cli.trie.tables import FRESH, NO_PPL, Node, SessionRecord, TableContext, decode_tables

if TYPE_CHECKING:
    from seqkv_cli.container.compact_reader import CompactReader
    from seqkv_cli.container.reader import ContainerReader

TRIE_VERSION = 1
# Positions a session may reach when no model says otherwise (per-vector archives, or before
# the model is loaded): past every context length in use, and it keeps one crafted node count
# from sizing an allocation.
MAX_POSITIONS = 1 << 20
# Tokens in one segment's token stream (decoded as one array): a few hundred full contexts.
MAX_SEGMENT_TOKENS = 1 << 24
_SEGMENT = re.compile(r"^t(\d+)/index$")


def part_name(segment: int, part: str) -> str:
    return f"t{segment}/{part}"


def session_part(segment: int, local: int, part: str) -> str:
    return f"t{segment}/s{local}/{part}"


def archive_header(pipeline_config: dict, model: dict, meta: dict) -> dict:
    """The container header of a trie archive: its sessions live in the segments' tables, so
    the header's own session list is empty and ``trie`` says which trie version reads them."""
    return {
        "pipeline": [pipeline_config],
        "model": model,
        "sessions": [],
        "meta": meta,
        "trie": {"version": TRIE_VERSION},
    }


@dataclass
class TrieContents:
    nodes: list[Node]
    sessions: list[SessionRecord]
    locals: list[int]  # each session's index within its segment
    profiles: dict[tuple[int, int], dict]  # (segment, profile) -> profile
    segments: list[int]
    kv_blocks: int
    context: TableContext = FRESH  # what a version-2 table of the next segment is written against
    embedded: dict[int, bytes] = field(default_factory=dict)  # segment -> tokens after its table
    # segment -> its codec id, where the segment is not coded by the archive's codec (1.7)
    codecs: dict[int, str] = field(default_factory=dict)

    def codec_of(self, segment: int, archive_codec: str) -> str:
        """The id of the codec that coded `segment`'s tokens."""
        return self.codecs.get(segment, archive_codec)


def load_trie(
    reader: ContainerReader | CompactReader, path: Path, max_context: int = MAX_POSITIONS
) -> TrieContents:
    """Read and cross-check every segment's tables (no token is decoded).

    No node may reach past `max_context` positions (the model's context where known).
    """
    compact = getattr(reader, "compact", None)  # a compact file: its tables are its header
    segments = sorted(int(m.group(1)) for s in reader.sections if (m := _SEGMENT.match(s.name)))
    if compact is not None:
        segments = [1]
    if segments != list(range(1, len(segments) + 1)):
        raise SeqkvError(f"{path}: trie segments are missing or out of order: {segments}")
    nodes: list[Node] = []
    sessions: list[SessionRecord] = []
    locals_: list[int] = []
    profiles: dict[tuple[int, int], dict] = {}
    kv_blocks = None
    context = FRESH
    embedded: dict[int, bytes] = {}
    codecs: dict[int, str] = {}
    for k in segments:
        where = f"{path} segment {k}"
        if compact is not None:
            from seqkv_cli.trie.compact import compact_tables

            tables = compact_tables(reader, where)
        else:
            raw = reader.read_section(part_name(k, "index"))
            tables = decode_tables(raw, len(nodes), where, context)
        context = context.after(tables)
        if tables.tokens is not None:
            embedded[k] = tables.tokens
        if tables.codec is not None:
            codecs[k] = tables.codec
        if kv_blocks is not None and tables.kv_blocks != kv_blocks:
            raise SeqkvError(f"{where}: K/V block count differs from earlier segments")
        kv_blocks = tables.kv_blocks
        payload = kv = tokens = 0
        for node in tables.nodes:
            node.segment, node.payload_offset, node.kv_offset = k, payload, kv
            node.token_offset = tokens
            payload, kv, tokens = (
                payload + node.payload,
                kv + sum(node.kv_lengths),
                tokens + node.n_tokens,
            )
            if node.parent >= 0:
                parent = nodes[node.parent] if node.parent < len(nodes) else None
                if parent is None or not 1 <= node.attach <= parent.n_tokens:
                    raise SeqkvError(f"{where}: a node branches off outside its parent")
                node.start = parent.start + node.attach
            elif node.attach:
                raise SeqkvError(f"{where}: a root node claims a branch point")
            if node.n_tokens == 0 or node.stop > max_context:
                raise SeqkvError(
                    f"{where}: a node has an impossible length "
                    f"(it reaches position {node.stop}; the limit is {max_context})"
                )
            nodes.append(node)
        if tokens > MAX_SEGMENT_TOKENS:
            raise SeqkvError(f"{where}: its nodes claim {tokens} tokens, over {MAX_SEGMENT_TOKENS}")
        for j, rec in enumerate(tables.sessions):
            end_node = nodes[rec.end_node]
            rec.end = end_node.n_tokens if rec.end < 0 else rec.end
            if not 1 <= rec.end <= end_node.n_tokens:
                raise SeqkvError(f"{where}: session {rec.id!r} ends outside its node")
            rec.segment = k
            sessions.append(rec)
            locals_.append(j)
        for i, profile in enumerate(tables.profiles):
            profiles[(k, i)] = profile
    ids = [s.id for s in sessions]
    if len(set(ids)) != len(ids):
        raise SeqkvError(f"{path}: a session id appears twice in the trie")
    return TrieContents(
        nodes, sessions, locals_, profiles, segments, kv_blocks or 0, context, embedded, codecs
    )


def check_context(contents: TrieContents, max_context: int, path: Path | str) -> None:
    """Refuse an archive whose nodes reach past the model's context (known once it is loaded)."""
    reach = max((node.stop for node in contents.nodes), default=0)
    if reach > max_context:
        raise SeqkvError(
            f"{path}: a trie node reaches position {reach}, past the model context ({max_context})"
        )


def session_entries(
    contents: TrieContents,
    section_sizes: dict[str, int],
    read: Callable[[str], bytes] | None = None,
) -> list[dict]:
    """Session entries in the shape the flat layout's header holds (restore, info, report).

    `read(name)` reads a section: a near-duplicate session's length is in its edits part.
    """
    out = []
    for index, (rec, local) in enumerate(zip(contents.sessions, contents.locals, strict=True)):
        profile = contents.profiles.get((rec.segment, rec.profile))
        if not isinstance(profile, dict) or not isinstance(profile.get("shapes"), dict):
            raise SeqkvError(f"session {rec.id!r}: its profile is missing or malformed")
        prefix = session_part(rec.segment, local, "")
        node = contents.nodes[rec.end_node]
        if not isinstance(profile.get("capture_meta", {}), dict):
            raise SeqkvError(f"session {rec.id!r}: its profile's capture metadata is malformed")
        meta = dict(profile.get("capture_meta", {}), **rec.extra)
        own = sorted(n for n in section_sizes if n.startswith(prefix))
        positions, centroid = node.start + rec.end, None
        if prefix + "edits" in section_sizes and read is not None:
            from seqkv_cli.trie.neardup_store import read_header

            centroid, positions, _ = read_header(read(prefix + "edits"))
            if not 0 <= centroid < len(contents.sessions) or centroid == index:
                raise SeqkvError(f"session {rec.id!r} names a missing centroid")
        out.append(
            {
                "id": rec.id,
                "index": index,
                "positions": positions,
                "dtype": profile.get("dtype"),
                "shapes": profile["shapes"],
                "numeric_path": profile.get("numeric_path", "unknown"),
                "log2_ppl": None if rec.log2_ppl_milli == NO_PPL else rec.log2_ppl_milli / 1000,
                "capture_meta": meta,
                "sections": own,
                "residual_bytes": sum(section_sizes[n] for n in own if "/residual." in n),
                "trie": {
                    "node": rec.end_node,
                    "end": rec.end,
                    "segment": rec.segment,
                    "local": local,
                    "centroid": centroid,
                },
            }
        )
    return out


class PartReader:
    """read(segment, part): a segment's shared part (tokens, kv, ...), read and checked once.

    An absent part (omitted because empty) reads as b"". A version-2 segment's tokens are
    those its table was followed by (`TrieContents.embedded`).
    """

    def __init__(
        self, reader: ContainerReader | CompactReader, embedded: dict[int, bytes] | None = None
    ) -> None:
        self.reader = reader
        self.known = {s.name for s in reader.sections}
        self.parts: dict[str, bytes] = {}
        self.embedded = embedded or {}

    def __call__(self, segment: int, part: str) -> bytes:
        if part == "tokens" and segment in self.embedded:
            return self.embedded[segment]
        name = part_name(segment, part)
        if name not in self.parts:
            self.parts[name] = self.reader.read_section(name) if name in self.known else b""
        return self.parts[name]


def chain(nodes: list[Node], node: int) -> list[int]:
    """Node indices from the root down to `node`."""
    out = []
    while node >= 0:
        out.append(node)
        node = nodes[node].parent
    return out[::-1]
