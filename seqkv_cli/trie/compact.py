"""A one-session trie archive as a compact file (format 1.2), and back.

A compact file is exactly a one-node, one-session trie archive without its JSON: the same
token payload (`t1/tokens`), with the node and session tables held in the container's binary
header. Reading turns that header into the tables `store.load_trie` would have built (`tables_of`);
`archive add` expands a compact file into the full layout with the same tables and payload
bytes before it appends (`archive add`). Which sessions qualify: `compact_form`.
"""

from __future__ import annotations

from seqkv_cli.container.compact import FINGERPRINT_HEX, CompactSession, unrepresentable
from seqkv_cli.trie.tables import Node, SegmentTables, SessionRecord

# What a compact file keeps about a session beyond what it needs to decode: nothing. The
# capture's provenance (source, capture time, versions) is dropped; a replay record and the
# metadata a library user gave (`add(meta=...)`) are not, so a session that carries one is
# never written compact.
KEPT_EXTRAS = ("replay", "meta")


def compact_form(build, config: dict, model: dict) -> tuple[CompactSession, bytes] | str:
    """The compact header and payload of a one-session segment, or why it cannot be one."""
    tables = build.tables
    if len(tables.sessions) != 1 or len(tables.nodes) != 1:
        return f"it holds {len(tables.sessions)} sessions"
    extra_parts = sorted(n for n in build.parts if n not in ("index", "tokens"))
    if extra_parts:
        return f"its session stores more than tokens ({extra_parts[0]})"
    (rec,), (node,), (profile,) = tables.sessions, tables.nodes, tables.profiles
    meta = dict(profile.get("capture_meta", {}), **rec.extra)
    kept = [k for k in KEPT_EXTRAS if k in meta]
    if kept:
        return f"its session carries a {kept[0]} record"
    if node.parent != -1 or rec.end != node.n_tokens or tables.kv_blocks:
        return "its session is not one whole node"
    fingerprint = str(model.get("fingerprint", ""))
    if len(fingerprint) < FINGERPRINT_HEX or any(c not in "0123456789abcdef" for c in fingerprint):
        return "its model has no SHA-256 fingerprint"
    reason = unrepresentable(config, profile["numeric_path"], profile["dtype"], rec.id)
    if reason:
        return reason
    shapes = profile["shapes"]
    session = CompactSession(
        codec=config["id"],
        residual=config["residual"],
        numerics=config["numerics"],
        fingerprint=fingerprint[:FINGERPRINT_HEX],
        session_id=rec.id,
        positions=node.n_tokens,
        dtype=profile["dtype"],
        numeric_path=profile["numeric_path"],
        num_layers=int(shapes["num_layers"]),
        num_kv_heads=int(shapes["num_kv_heads"]),
        head_dim=int(shapes["head_dim"]),
        log2_ppl_milli=rec.log2_ppl_milli,
        token_check=node.check,
    )
    return session, build.parts["tokens"]


def tables_of(session: CompactSession, payload_bytes: int) -> SegmentTables:
    """The segment tables a full trie archive of this one session holds."""
    # `seq` codes each node as its own stream (its length is in the table); `seq-fast` codes
    # a segment's tokens as one stream, and its nodes record no payload.
    payload = payload_bytes if session.codec == "seq" else 0
    node = Node(-1, 0, session.positions, payload, session.token_check)
    profile = {
        "dtype": session.dtype,
        "numeric_path": session.numeric_path,
        "shapes": {
            "num_layers": session.num_layers,
            "num_kv_heads": session.num_kv_heads,
            "head_dim": session.head_dim,
        },
        "capture_meta": {},
    }
    record = SessionRecord(session.session_id, 0, session.positions, session.log2_ppl_milli)
    return SegmentTables([node], [record], [profile])
