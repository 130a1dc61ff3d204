"""The binary node and session tables of one trie segment (docs/FORMAT.md, "Trie archives").

JSON costs hundreds of bytes per session; a branch under a good model costs less than that,
so these tables are varints: a session that adds one branch costs about a dozen bytes beyond
its coded tokens. Every field is checked on read; a damaged table raises SeqkvError naming
what is wrong, never an IndexError.
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass, field

from seqkv_cli.container.format import MAX_INDEX_BYTES
from seqkv_cli.errors import SeqkvError
from seqkv_codecs.errors import CorruptStreamError
from seqkv_codecs.varint import decode_varint, encode_varint, zigzag_decode, zigzag_encode

MAGIC = b"SKTI"
VERSION = 1
NO_PPL = 0xFFFF  # log2 PP unknown (sessions of fewer than two tokens)
_HEAD = struct.Struct("<4sBB")  # magic, version, flags
FLAG_PROFILES = 1  # sessions carry a profile index (more than one profile in the segment)
# The session names and profiles are what a flat file keeps in its JSON index, so they get
# the index's cap once inflated; a zlib bomb stops there instead of filling memory.
# Within that cap, a segment's names may take 1 MiB plus 64 KiB per session it declares.
MAX_NAMES_BYTES = MAX_INDEX_BYTES
NAMES_BYTES_BASE, NAMES_BYTES_PER_SESSION = 1 << 20, 64 << 10
MAX_JSON_DEPTH = 32  # profiles and extras are capture metadata: a few levels, never hundreds


@dataclass
class Node:
    """A run of tokens that continues `parent` after its first `attach` tokens (or a root)."""

    parent: int  # global node index, -1 for a root
    attach: int
    n_tokens: int
    payload: int  # bytes of this node's token stream (seq) — 0 where tokens are coded jointly
    check: int  # 16-bit token checksum
    kv_lengths: tuple[int, ...] = ()  # per-vector codecs: bytes of each stored K/V block
    # Filled in when an archive is loaded:
    segment: int = 0
    payload_offset: int = 0
    kv_offset: int = 0
    token_offset: int = 0  # index of the node's first token in its segment's token array
    start: int = 0  # absolute position of the node's first token

    @property
    def stop(self) -> int:
        return self.start + self.n_tokens


@dataclass
class SessionRecord:
    """A session: the path from a root down to `end` tokens into node `end_node`."""

    id: str
    end_node: int
    end: int
    log2_ppl_milli: int = NO_PPL
    profile: int = 0
    extra: dict = field(default_factory=dict)
    segment: int = 0


@dataclass
class SegmentTables:
    nodes: list[Node]
    sessions: list[SessionRecord]
    profiles: list[dict]
    kv_blocks: int = 0


def _varint(value: int, out: bytearray) -> None:
    if value < 0:
        raise SeqkvError(f"internal: negative varint {value}")
    out += encode_varint(value)


class _Reader:
    def __init__(self, data: bytes, where: str) -> None:
        self.data, self.pos, self.where = data, 0, where

    def fail(self, what: str) -> SeqkvError:
        return SeqkvError(f"{self.where}: trie table is damaged ({what})")

    def varint(self) -> int:
        try:
            value, self.pos = decode_varint(self.data, self.pos)
        except CorruptStreamError:
            raise self.fail("a number runs past the end") from None
        return value

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise self.fail("truncated")
        chunk = self.data[self.pos : self.pos + n]
        self.pos += n
        return chunk


def encode_tables(tables: SegmentTables, first_node: int) -> bytes:
    """Serialise one segment's tables; `first_node` is the global index of its first node."""
    flags = FLAG_PROFILES if len(tables.profiles) > 1 else 0
    out = bytearray(_HEAD.pack(MAGIC, VERSION, flags))
    for value in (len(tables.nodes), len(tables.sessions), tables.kv_blocks):
        _varint(value, out)
    for k, node in enumerate(tables.nodes):
        index = first_node + k
        _varint(0 if node.parent < 0 else index - node.parent, out)
        for value in (node.attach, node.n_tokens, node.payload):
            _varint(value, out)
        out += node.check.to_bytes(2, "little")
        if len(node.kv_lengths) != tables.kv_blocks:
            raise SeqkvError("internal: a node has the wrong number of K/V blocks")
        for length in node.kv_lengths:
            _varint(length, out)
    previous = first_node - 1
    node_tokens = {first_node + k: n.n_tokens for k, n in enumerate(tables.nodes)}
    for rec in tables.sessions:
        full = node_tokens.get(rec.end_node) == rec.end
        _varint(zigzag_encode(rec.end_node - previous) * 2 + (0 if full else 1), out)
        if not full:
            _varint(rec.end, out)
        out += rec.log2_ppl_milli.to_bytes(2, "little")
        if flags & FLAG_PROFILES:
            _varint(rec.profile, out)
        previous = rec.end_node
    strings = {
        "profiles": tables.profiles,
        "sessions": [[r.id, r.extra] if r.extra else [r.id] for r in tables.sessions],
    }
    packed = zlib.compress(json.dumps(strings, separators=(",", ":")).encode(), 9)
    _varint(len(packed), out)
    return bytes(out + packed)


def decode_tables(data: bytes, first_node: int, where: str) -> SegmentTables:
    """Parse one segment's tables; node references must point at nodes that exist before.

    A session's `end` is -1 when it runs to the end of its node (resolved by the loader,
    which knows nodes of earlier segments too).
    """
    r = _Reader(bytes(data), where)
    magic, version, flags = _HEAD.unpack(r.take(_HEAD.size))
    if magic != MAGIC:
        raise r.fail(f"magic {magic!r}")
    if version != VERSION:
        raise SeqkvError(f"{where}: trie table version {version} is newer; upgrade seqkv")
    n_nodes, n_sessions, kv_blocks = r.varint(), r.varint(), r.varint()
    if max(n_nodes, n_sessions, kv_blocks) > len(data):
        raise r.fail("impossible counts")
    nodes = []
    for k in range(n_nodes):
        index = first_node + k
        back = r.varint()
        if back > index:
            raise r.fail(f"node {index} points at a parent before the first node")
        attach, n_tokens, payload = r.varint(), r.varint(), r.varint()
        check = int.from_bytes(r.take(2), "little")
        lengths = tuple(r.varint() for _ in range(kv_blocks))
        parent = -1 if back == 0 else index - back
        nodes.append(Node(parent, attach, n_tokens, payload, check, lengths))
    total_nodes = first_node + n_nodes
    sessions, previous = [], first_node - 1
    for _ in range(n_sessions):
        code = r.varint()
        end_node = previous + zigzag_decode(code >> 1)
        if not 0 <= end_node < total_nodes:
            raise r.fail(f"a session ends in node {end_node}, which does not exist")
        end = r.varint() if code & 1 else None
        ppl = int.from_bytes(r.take(2), "little")
        profile = r.varint() if flags & FLAG_PROFILES else 0
        sessions.append(SessionRecord("", end_node, -1 if end is None else end, ppl, profile))
        previous = end_node
    try:
        limit = min(MAX_NAMES_BYTES, NAMES_BYTES_BASE + NAMES_BYTES_PER_SESSION * n_sessions)
        strings = json.loads(_inflate(r.take(r.varint()), limit, r))
        profiles, rows = strings["profiles"], strings["sessions"]
    except (zlib.error, ValueError, KeyError, TypeError, RecursionError):
        raise r.fail("its session names do not decompress") from None
    if too_deep(strings, MAX_JSON_DEPTH):
        raise r.fail(f"its session names nest deeper than {MAX_JSON_DEPTH} levels")
    if r.pos != len(r.data):
        raise r.fail(f"{len(r.data) - r.pos} trailing bytes")
    if not isinstance(profiles, list) or not isinstance(rows, list) or len(rows) != n_sessions:
        raise r.fail("session names do not match the session count")
    for rec, row in zip(sessions, rows, strict=True):
        if not (isinstance(row, list) and row and isinstance(row[0], str) and row[0]):
            raise r.fail("a session has no name")
        rec.id = row[0]
        rec.extra = row[1] if len(row) > 1 and isinstance(row[1], dict) else {}
        if not 0 <= rec.profile < len(profiles) or not isinstance(profiles[rec.profile], dict):
            raise r.fail(f"session {rec.id!r} names a missing profile")
    return SegmentTables(nodes, sessions, profiles, kv_blocks)


def _inflate(packed: bytes, limit: int, r: _Reader) -> bytes:
    """zlib data, refused as soon as it would inflate past `limit` bytes."""
    inflater = zlib.decompressobj()
    out = inflater.decompress(packed, limit)
    if inflater.unconsumed_tail:
        raise r.fail(f"its session names inflate past {limit} bytes")
    if not inflater.eof:
        raise r.fail("its session names are truncated")
    if inflater.unused_data:
        raise r.fail("its session names carry trailing bytes")
    return out


def too_deep(value: object, limit: int) -> bool:
    """Nesting depth over `limit` (iterative: later readers of the values may recurse)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth > limit:
                return True
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return False
