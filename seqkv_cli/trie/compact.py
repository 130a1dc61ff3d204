"""One trie segment as a compact file, and back.

A compact single-session file (format 1.2) is exactly a one-node, one-session trie archive
without its JSON: the same token payload (`t1/tokens`), with the node and session tables held
in the container's binary header. A compact archive (format 1.8) holds any number of sessions
that share one profile: its table is the version-2 segment table the full layout would hold,
written against that profile (so it stores none) with the ends of sessions inside a node
relative to each other, deflated by the container. Reading turns either into the tables
`store.load_trie` would have built (`compact_tables`); `archive add` expands a compact file into
the full layout with the same tables and payload bytes before it appends (`expanded`). Which
segments qualify: `compact_form`, `compact_archive_form`.
"""

from __future__ import annotations

import dataclasses

from seqkv_cli.container.compact import (
    ARCHIVE_MINOR,
    ARCHIVE_SECTION,
    FINGERPRINT_HEX,
    CompactProfile,
    CompactSession,
    id_problem,
    unrepresentable,
)
from seqkv_cli.container.format import REPLAY_MINOR
from seqkv_cli.errors import SeqkvError
from seqkv_cli.trie.replay_records import binary_form
from seqkv_cli.trie.tables import (
    FLAG_INHERITED,
    FLAG_REPLAY,
    FRESH,
    V2_TAG,
    V2_WIDE_TAG,
    Node,
    SegmentTables,
    SessionRecord,
    TableContext,
    decode_tables,
    encode_tables,
)

# A compact archive's table is a version-2 table whose profiles are the header's: it sets
# that flag and no other (no creation time, codec, K/V blocks, profile index or JSON block),
# but, in a format 1.9 file, the replay flag (its sessions' records, in binary).
ARCHIVE_TABLE_TAG = V2_TAG | FLAG_INHERITED
REPLAY_TABLE_TAG = V2_WIDE_TAG | FLAG_REPLAY | FLAG_INHERITED

# What a compact file keeps about a session beyond what it needs to decode: nothing. The
# capture's provenance (source, capture time, versions) is dropped; a replay record and the
# metadata a library user gave (`add(meta=...)`) are not, so a session that carries one is
# never written as a compact single-session file (it has no table), and a compact archive
# holds a replay record only in binary (format 1.9).
KEPT_EXTRAS = ("replay", "meta")


def compact_form(build, config: dict, model: dict) -> tuple[CompactSession, bytes] | str:
    """The compact header and payload of a one-session segment, or why it cannot be one."""
    tables = build.tables
    if len(tables.sessions) != 1 or len(tables.nodes) != 1:
        return f"it holds {len(tables.sessions)} sessions"
    (rec,), (node,) = tables.sessions, tables.nodes
    if node.parent != -1 or rec.end != node.n_tokens:
        return "its session is not one whole node"
    head = _shared_head(build, config, model, records=False)
    if isinstance(head, str):
        return head
    session = CompactSession(
        **dataclasses.asdict(head),
        session_id=rec.id,
        positions=node.n_tokens,
        log2_ppl_milli=rec.log2_ppl_milli,
        token_check=node.check,
    )
    return session, build.parts["tokens"]


def compact_archive_form(
    build, config: dict, model: dict
) -> tuple[CompactProfile, bytes, bytes, int] | str:
    """The compact archive header, table, payload and format minor of a segment, or why it
    cannot be one."""
    tables = build.tables
    if not tables.sessions:
        return "it holds no session"
    head = _shared_head(build, config, model, records=True)
    if isinstance(head, str):
        return head
    profile = tables.profiles[0]
    records = [_meta(profile, r).get("replay") for r in tables.sessions]
    bare = SegmentTables(
        tables.nodes,
        [
            SessionRecord(r.id, r.end_node, r.end, r.log2_ppl_milli, 0, {"replay": x} if x else {})
            for r, x in zip(tables.sessions, records, strict=True)
        ],
        [profile_of(head)],
    )
    table = encode_tables(bare, 0, archive_context(head), relative_ends=True)
    minor = REPLAY_MINOR if any(records) else ARCHIVE_MINOR
    return head, table, build.parts.get("tokens", b""), minor


def _meta(profile: dict, rec: SessionRecord) -> dict:
    return dict(profile.get("capture_meta", {}), **rec.extra)


def _shared_head(build, config: dict, model: dict, records: bool) -> CompactProfile | str:
    """What a compact header says of a segment's sessions, or why it cannot say it: they
    keep nothing but tokens (and, with `records`, replay records a 1.9 table holds in
    binary), share one profile, and have ids a compact file holds."""
    tables = build.tables
    extra_parts = sorted(n for n in build.parts if n not in ("index", "tokens"))
    if extra_parts:
        return f"a session stores more than tokens ({extra_parts[0]})"
    if len(tables.profiles) != 1:
        return "its sessions differ in dtype, numeric path or shape"
    if tables.kv_blocks or tables.codec:
        return "its tokens are not coded by the archive's own codec"
    (profile,) = tables.profiles
    for rec in tables.sessions:
        meta = _meta(profile, rec)
        held = records and binary_form(meta.get("replay")) is not None
        kept = [k for k in KEPT_EXTRAS if k in meta and not (k == "replay" and held)]
        if kept:
            return f"session {rec.id!r} carries a {kept[0]} record"
        if id_problem(rec.id):
            return f"a session id is {id_problem(rec.id)}"
    fingerprint = str(model.get("fingerprint", ""))
    if len(fingerprint) < FINGERPRINT_HEX or any(c not in "0123456789abcdef" for c in fingerprint):
        return "its model has no SHA-256 fingerprint"
    reason = unrepresentable(config, profile["numeric_path"], profile["dtype"])
    if reason:
        return reason
    shapes = profile["shapes"]
    return CompactProfile(
        codec=config["id"],
        residual=config["residual"],
        numerics=config["numerics"],
        fingerprint=fingerprint[:FINGERPRINT_HEX],
        dtype=profile["dtype"],
        numeric_path=profile["numeric_path"],
        num_layers=int(shapes["num_layers"]),
        num_kv_heads=int(shapes["num_kv_heads"]),
        head_dim=int(shapes["head_dim"]),
    )


def profile_of(head: CompactProfile) -> dict:
    """The trie profile a compact file's sessions have: no capture metadata."""
    return {
        "dtype": head.dtype,
        "numeric_path": head.numeric_path,
        "shapes": {
            "num_layers": head.num_layers,
            "num_kv_heads": head.num_kv_heads,
            "head_dim": head.head_dim,
        },
        "capture_meta": {},
    }


def archive_context(head: CompactProfile) -> TableContext:
    """What a compact archive's table is written against: no session before, the header's
    profile as the profile before."""
    return TableContext("", (profile_of(head),), 0)


def compact_tables(reader, where: str) -> SegmentTables:
    """The one segment's tables of a compact file (a compact archive's with its tokens, and
    every session's end resolved)."""
    head = reader.compact
    if not getattr(reader, "archive", False):
        return tables_of(head, reader.sections[0].length)
    raw = reader.read_section(ARCHIVE_SECTION)
    # a table with replay records only in a file that says so (a 1.8 reader asks to upgrade)
    tags = {ARCHIVE_TABLE_TAG, REPLAY_TABLE_TAG if reader.version[1] >= REPLAY_MINOR else -1}
    if not raw or raw[0] not in tags:
        raise SeqkvError(f"{where}: trie table is damaged (not a compact archive's table)")
    tables = decode_tables(raw, 0, where, archive_context(head), relative_ends=True)
    if len(tables.tokens or b"") != reader.payload_bytes:  # the table must end where it says
        raise SeqkvError(f"{where}: trie table is damaged (bytes after its end)")
    for rec in tables.sessions:
        if rec.end < 0:
            rec.end = tables.nodes[rec.end_node].n_tokens
    return tables


def expanded(reader, where: str) -> tuple[bytes, bytes]:
    """A compact file's table and tokens as the full layout's first segment holds them (a
    new 1.6+ file: its table written against nothing before it)."""
    tables = compact_tables(reader, where)
    payload = tables.tokens
    if payload is None:
        payload = reader.read_section(reader.sections[0].name)
    bare = SegmentTables(tables.nodes, tables.sessions, tables.profiles)
    return encode_tables(bare, 0, FRESH), payload


def tables_of(session: CompactSession, payload_bytes: int) -> SegmentTables:
    """The segment tables a full trie archive of this one session holds."""
    # `seq` codes each node as its own stream (its length is in the table); `seq-fast` codes
    # a segment's tokens as one stream, and its nodes record no payload.
    payload = payload_bytes if session.codec == "seq" else 0
    node = Node(-1, 0, session.positions, payload, session.token_check)
    record = SessionRecord(session.session_id, 0, session.positions, session.log2_ppl_milli)
    return SegmentTables([node], [record], [profile_of(session)])
