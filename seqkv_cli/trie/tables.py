"""The binary node and session tables of one trie segment (docs/FORMAT.md, "Trie archives").

JSON costs hundreds of bytes per session; a branch under a good model costs less than that,
so these tables are varints: a session that adds one branch costs about a dozen bytes beyond
its coded tokens. Every field is checked on read; a damaged table raises SeqkvError naming
what is wrong, never an IndexError.

Version 1 repeats, in every segment, the profile (dtype, numeric path, shapes, capture
metadata) and each session's name, zlib'd: ~230 bytes a segment, where an agent's turn of
100 new tokens codes to ~60. Version 2 (format 1.6 files) writes a segment against the
archive before it (`TableContext`): the profiles are "as the segment before" when they are,
the creation time a signed number of seconds after the one before, and each session id the
bytes it does not share with the id before it.
"""

from __future__ import annotations

import copy
import datetime as dt
import json
import struct
import zlib
from dataclasses import dataclass, field

from seqkv_cli.container.format import MAX_INDEX_BYTES
from seqkv_cli.container.index import shared_prefix
from seqkv_cli.errors import SeqkvError
from seqkv_cli.trie.replay_records import (
    NO_RECORDS,
    ReplayContext,
    binary_form,
    decode_block,
    encode_block,
)
from seqkv_codecs.errors import CorruptStreamError
from seqkv_codecs.varint import decode_varint, encode_varint, zigzag_decode, zigzag_encode

MAGIC = b"SKTI"
VERSION = 1
# A version-2 table starts with one byte instead of MAGIC + version + flags: 0x20 | flags
# (0x20-0x3f; a version-1 table starts with "S", 0x53). After the table come the segment's
# tokens, which version 1 keeps in a section of their own (t<k>/tokens).
V2_TAG, V2_FLAGS = 0x20, 0x1F
# Format 1.7 adds a sixth flag (FLAG_CODEC); a table that sets it starts 0x80 | flags instead
# (0x80-0xbf). Format 1.9 adds a seventh (FLAG_REPLAY): 0x80 | flags with bit 6 is 0xc0 and up,
# which a 1.7 or 1.8 reader refuses asking for an upgrade. Tables without them keep their
# 1.6 bytes.
V2_WIDE_TAG, V2_WIDE_FLAGS = 0x80, 0x7F
NO_PPL = 0xFFFF  # log2 PP unknown (sessions of fewer than two tokens)
_HEAD = struct.Struct("<4sBB")  # magic, version, flags
FLAG_PROFILES = 1  # sessions carry a profile index (more than one profile in the segment)
# version 2 only:
FLAG_INHERITED = 2  # the profiles are the segment before's (none stored)
FLAG_CREATED = 4  # a creation time: zigzag seconds after the segment before's
FLAG_STRINGS = 8  # a zlib'd JSON block ends the table (profiles; the ids with their metadata)
FLAG_KV = 16  # a K/V block count follows (per-vector codecs; 0 when absent)
# format 1.7: the segment's codec id follows (its length, then ASCII), where it is not the
# archive's (`open_archive(load="fast")` on a `seq` archive keeps that turn as `seq-fast`)
FLAG_CODEC = 32
MAX_CODEC_ID = 32
# format 1.9: the sessions' replay records follow the ids, in binary (replay_records.py)
FLAG_REPLAY = 64
CREATED_FORMAT = "%Y-%m-%dT%H:%M:%SZ"  # seqkv_cli.clock writes these; others stay JSON
MAX_CREATED = 1 << 40  # seconds: some 30,000 years, and a bound on a crafted delta
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
    tokens: bytes | None = None  # version 2 read: the segment's tokens, after the table
    codec: str | None = None  # the segment's codec id where it is not the archive's (1.7)


@dataclass(frozen=True)
class TableContext:
    """What a version-2 segment table is written against and read with: the archive so far.

    `FRESH` (a new file) shares nothing. `after(tables)` is the context of the next segment.
    """

    last_id: str = ""  # the id of the archive's newest session
    profiles: tuple = ()  # the segment before's profiles, as it stored them
    created: int = 0  # the segment before's creation time (Unix seconds; 0 if none)
    replay: ReplayContext = NO_RECORDS  # the replay records before (format 1.9)
    # whether a table written in this context may hold binary replay records: a file of
    # format 1.9; appends to an older file keep them as JSON, which its readers know
    binary_replay: bool = True

    def after(self, tables: SegmentTables) -> TableContext:
        stored, created = stored_profiles(tables.profiles)
        last = tables.sessions[-1].id if tables.sessions else self.last_id
        replay = self.replay
        for rec in tables.sessions:
            replay = replay.then(rec.extra.get("replay"))
        when = self.created if created is None else created
        return TableContext(last, tuple(stored), when, replay, self.binary_replay)


FRESH = TableContext()


def stored_profiles(profiles: list[dict]) -> tuple[list[dict], int | None]:
    """The profiles without their creation time, and that time, where every profile's capture
    metadata holds the same one in seqkv's own format (else the profiles as they are)."""
    times = {_meta(p).get("created") for p in profiles}
    if len(times) != 1:
        return profiles, None
    (text,) = times
    seconds = _seconds(text)
    if seconds is None:
        return profiles, None
    bare = [
        dict(p, capture_meta={k: v for k, v in _meta(p).items() if k != "created"})
        for p in profiles
    ]
    return bare, seconds


def _meta(profile: object) -> dict:
    meta = profile.get("capture_meta") if isinstance(profile, dict) else None
    return meta if isinstance(meta, dict) else {}


def _seconds(text: object) -> int | None:
    """Unix seconds of a `created` string that formats back to itself, else None."""
    if not isinstance(text, str):
        return None
    try:
        when = dt.datetime.strptime(text, CREATED_FORMAT).replace(tzinfo=dt.UTC)
    except ValueError:
        return None
    seconds = int(when.timestamp())
    return seconds if 0 < seconds < MAX_CREATED and _created(seconds) == text else None


def _created(seconds: int) -> str:
    return dt.datetime.fromtimestamp(seconds, dt.UTC).strftime(CREATED_FORMAT)


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


def encode_tables(
    tables: SegmentTables,
    first_node: int,
    context: TableContext | None = None,
    relative_ends: bool = False,
) -> bytes:
    """Serialise one segment's tables; `first_node` is the global index of its first node.

    With a `context` (a format 1.6 file) the table is version 2, written against the archive
    before it; without, version 1 (files that older seqkv read and extend). `relative_ends`
    (a compact archive's table, format 1.8): a session that ends inside its node states its
    end against the session before it when that one ends inside the same node (an agent's
    turns merged into one node end 100, 200, ... tokens in: the same small number each)."""
    if context is not None:
        return _encode_2(tables, first_node, context, relative_ends)
    flags = FLAG_PROFILES if len(tables.profiles) > 1 else 0
    out = bytearray(_HEAD.pack(MAGIC, VERSION, flags))
    _counts_and_rows(tables, first_node, flags, out)
    _pack_strings({"profiles": tables.profiles, "sessions": _name_rows(tables)}, out)
    return bytes(out)


def _name_rows(tables: SegmentTables, extras: list[dict] | None = None) -> list[list]:
    """Each session's id, with its own metadata where it has any (both versions); `extras`:
    that metadata where it is not the sessions' own (less the records held in binary)."""
    extras = [r.extra for r in tables.sessions] if extras is None else extras
    return [[r.id, e] if e else [r.id] for r, e in zip(tables.sessions, extras, strict=True)]


def _pack_strings(strings: dict, out: bytearray) -> None:
    """The zlib'd JSON block that ends a table: its length, then its bytes."""
    packed = zlib.compress(json.dumps(strings, separators=(",", ":")).encode(), 9)
    _varint(len(packed), out)
    out += packed


def _encode_2(
    tables: SegmentTables, first_node: int, context: TableContext, relative_ends: bool = False
) -> bytes:
    stored, created = stored_profiles(tables.profiles)
    inherited = bool(stored) and tuple(stored) == context.profiles
    records = [r.extra.get("replay") for r in tables.sessions]
    binary = context.binary_replay and any(binary_form(x) is not None for x in records)
    own = [
        {k: v for k, v in r.extra.items() if k != "replay" or binary_form(v) is None}
        if binary
        else r.extra
        for r in tables.sessions
    ]
    extras = any(own)
    flags = FLAG_PROFILES if len(tables.profiles) > 1 else 0
    flags |= FLAG_INHERITED if inherited else 0
    flags |= 0 if created is None else FLAG_CREATED
    flags |= FLAG_STRINGS if extras or not inherited else 0
    flags |= FLAG_KV if tables.kv_blocks else 0
    flags |= FLAG_CODEC if tables.codec else 0
    flags |= FLAG_REPLAY if binary else 0
    wide = flags & (FLAG_CODEC | FLAG_REPLAY)
    out = bytearray([(V2_WIDE_TAG if wide else V2_TAG) | flags])
    if created is not None:
        _varint(zigzag_encode(created - context.created), out)
    if tables.codec:
        name = tables.codec.encode("ascii")
        if not 0 < len(name) <= MAX_CODEC_ID:
            raise SeqkvError(f"internal: codec id {tables.codec!r} cannot be stored")
        _varint(len(name), out)
        out += name
    _counts_and_rows(tables, first_node, flags, out, 2, relative_ends)
    if flags & FLAG_STRINGS:
        # the ids with their metadata, as version 1 writes them: zlib finds what they share
        strings: dict = {} if inherited else {"profiles": stored}
        _pack_strings(dict(strings, sessions=_name_rows(tables, own)), out)
    else:  # each id front-coded against the one before
        before = context.last_id.encode()
        for rec in tables.sessions:
            name = rec.id.encode()
            shared = shared_prefix(before, name)
            _varint(shared, out)
            _varint(len(name) - shared, out)
            out += name[shared:]
            before = name
    if binary:
        encode_block(records, context.replay, out, _varint)
    return bytes(out)


def _counts_and_rows(
    tables: SegmentTables,
    first_node: int,
    flags: int,
    out: bytearray,
    version: int = VERSION,
    relative_ends: bool = False,
) -> None:
    """The counts, the node table and the session table: the same in both versions (version
    2 writes the K/V block count only where there are blocks)."""
    counts = [len(tables.nodes), len(tables.sessions)]
    if version == VERSION or flags & FLAG_KV:
        counts.append(tables.kv_blocks)
    for value in counts:
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
    inside = 0  # the end of the session before, where it ended inside the same node
    for rec in tables.sessions:
        full = node_tokens.get(rec.end_node) == rec.end
        same = rec.end_node == previous
        _varint(zigzag_encode(rec.end_node - previous) * 2 + (0 if full else 1), out)
        if not full:
            if relative_ends:
                _varint(zigzag_encode(rec.end - (inside if same else 0)), out)
            else:
                _varint(rec.end, out)
        out += rec.log2_ppl_milli.to_bytes(2, "little")
        if flags & FLAG_PROFILES:
            _varint(rec.profile, out)
        previous, inside = rec.end_node, (0 if full else rec.end)


def decode_tables(
    data: bytes,
    first_node: int,
    where: str,
    context: TableContext | None = None,
    relative_ends: bool = False,
) -> SegmentTables:
    """Parse one segment's tables; node references must point at nodes that exist before.

    A session's `end` is -1 when it runs to the end of its node (resolved by the loader,
    which knows nodes of earlier segments too). A version-2 table is read against `context`
    (the archive before it; FRESH for the first segment); `relative_ends` as `encode_tables`.
    """
    r = _Reader(bytes(data), where)
    if r.data[:1] and _tag_flags(r.data[0]) is not None:
        return _decode_2(r, first_node, FRESH if context is None else context, relative_ends)
    if relative_ends:
        raise r.fail("a compact archive's table is not a version-2 table")
    magic, version, flags = _HEAD.unpack(r.take(_HEAD.size))
    if magic != MAGIC:
        if r.data[0] < 0x20:  # what a later version would start with, not damage
            raise SeqkvError(f"{where}: trie table version {r.data[0]} is newer; upgrade seqkv")
        raise r.fail(f"magic {magic!r}")
    if version != VERSION:
        raise SeqkvError(f"{where}: trie table version {version} is newer; upgrade seqkv")
    nodes, sessions, kv_blocks = _rows(r, first_node, flags)
    try:
        strings = json.loads(_inflate(r.take(r.varint()), _names_limit(len(sessions)), r))
        profiles, rows = strings["profiles"], strings["sessions"]
    except (zlib.error, ValueError, KeyError, TypeError, RecursionError):
        raise r.fail("its session names do not decompress") from None
    if too_deep(strings, MAX_JSON_DEPTH):
        raise r.fail(f"its session names nest deeper than {MAX_JSON_DEPTH} levels")
    if r.pos != len(r.data):
        raise r.fail(f"{len(r.data) - r.pos} trailing bytes")
    if not isinstance(profiles, list) or not isinstance(rows, list) or len(rows) != len(sessions):
        raise r.fail("session names do not match the session count")
    for rec, row in zip(sessions, rows, strict=True):
        if not (isinstance(row, list) and row and isinstance(row[0], str) and row[0]):
            raise r.fail("a session has no name")
        rec.id = row[0]
        rec.extra = row[1] if len(row) > 1 and isinstance(row[1], dict) else {}
    _check_profiles(r, sessions, profiles)
    return SegmentTables(nodes, sessions, profiles, kv_blocks)


def _names_limit(n_sessions: int) -> int:
    return min(MAX_NAMES_BYTES, NAMES_BYTES_BASE + NAMES_BYTES_PER_SESSION * n_sessions)


def _rows(
    r: _Reader, first_node: int, flags: int, version: int = VERSION, relative_ends: bool = False
) -> tuple[list[Node], list[SessionRecord], int]:
    """The counts, node table and session table (both versions); ids are filled in later."""
    n_nodes, n_sessions = r.varint(), r.varint()
    kv_blocks = r.varint() if version == VERSION or flags & FLAG_KV else 0
    if max(n_nodes, n_sessions, kv_blocks) > len(r.data):
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
    sessions, previous, inside = [], first_node - 1, 0
    for _ in range(n_sessions):
        code = r.varint()
        end_node = previous + zigzag_decode(code >> 1)
        if not 0 <= end_node < total_nodes:
            raise r.fail(f"a session ends in node {end_node}, which does not exist")
        end = None
        if code & 1:
            end = r.varint()
            if relative_ends:
                end = zigzag_decode(end) + (inside if end_node == previous else 0)
                if end < 1:  # the loader checks the upper bound against its node
                    raise r.fail("a session ends before its node starts")
        ppl = int.from_bytes(r.take(2), "little")
        profile = r.varint() if flags & FLAG_PROFILES else 0
        sessions.append(SessionRecord("", end_node, -1 if end is None else end, ppl, profile))
        previous, inside = end_node, (0 if end is None else end)
    return nodes, sessions, kv_blocks


def _check_profiles(r: _Reader, sessions: list[SessionRecord], profiles: object) -> None:
    for rec in sessions:
        if (
            not isinstance(profiles, list)
            or not 0 <= rec.profile < len(profiles)
            or not isinstance(profiles[rec.profile], dict)
        ):
            raise r.fail(f"session {rec.id!r} names a missing profile")


def _tag_flags(first: int) -> int | None:
    """The flags of a version-2 table's first byte; None for another kind of table."""
    if first & ~V2_FLAGS == V2_TAG:
        return first & V2_FLAGS
    if first & ~V2_WIDE_FLAGS == V2_WIDE_TAG and first & (FLAG_CODEC | FLAG_REPLAY):
        return first & V2_WIDE_FLAGS
    return None


def _decode_2(
    r: _Reader, first_node: int, context: TableContext, relative_ends: bool = False
) -> SegmentTables:
    flags = _tag_flags(r.take(1)[0]) or 0
    created = None
    if flags & FLAG_CREATED:
        created = context.created + zigzag_decode(r.varint())
        if not 0 < created < MAX_CREATED:
            raise r.fail("its creation time is out of range")
    codec = None
    if flags & FLAG_CODEC:
        size = r.varint()
        if not 0 < size <= MAX_CODEC_ID:
            raise r.fail("its codec id has an impossible length")
        raw = r.take(size)
        if not raw.isascii() or not raw.decode().replace("-", "").isalnum():
            raise r.fail("its codec id is not a codec name")
        codec = raw.decode()
    nodes, sessions, kv_blocks = _rows(r, first_node, flags, 2, relative_ends)
    if not flags & FLAG_STRINGS:
        _front_coded_ids(r, sessions, context.last_id)
    strings: dict = {}
    if flags & FLAG_STRINGS:
        try:
            strings = json.loads(_inflate(r.take(r.varint()), _names_limit(len(sessions)), r))
        except (zlib.error, ValueError, RecursionError):
            raise r.fail("its profiles do not decompress") from None
        if not isinstance(strings, dict) or too_deep(strings, MAX_JSON_DEPTH):
            raise r.fail(f"its profiles are not an object nesting at most {MAX_JSON_DEPTH} levels")
    if flags & FLAG_STRINGS:
        rows = strings.get("sessions")
        if not isinstance(rows, list) or len(rows) != len(sessions):
            raise r.fail("session names do not match the session count")
        for rec, row in zip(sessions, rows, strict=True):
            if not (isinstance(row, list) and row and isinstance(row[0], str) and row[0]):
                raise r.fail("a session has no name")
            if len(row) > 2 or (len(row) == 2 and not isinstance(row[1], dict)):
                raise r.fail("a session's metadata is not an object")
            rec.id, rec.extra = row[0], row[1] if len(row) == 2 else {}
    if flags & FLAG_REPLAY:
        for rec, record in zip(
            sessions, decode_block(r, len(sessions), context.replay), strict=True
        ):
            if record is not None and "replay" in rec.extra:
                raise r.fail(f"session {rec.id!r} has its replay record twice")
            if record is not None:
                rec.extra = {**rec.extra, "replay": record}
    if bool(flags & FLAG_INHERITED) == ("profiles" in strings):
        raise r.fail("its profiles are both inherited and stored, or neither")
    inherited = flags & FLAG_INHERITED
    profiles = copy.deepcopy(list(context.profiles)) if inherited else strings["profiles"]
    _check_profiles(r, sessions, profiles)
    if created is not None:
        stamp = _created(created)
        profiles = [dict(p, capture_meta=dict(_meta(p), created=stamp)) for p in profiles]
    return SegmentTables(nodes, sessions, profiles, kv_blocks, r.data[r.pos :], codec)


def is_version_2(index: bytes) -> bool:
    """Whether a segment's encoded table is version 2 (its tokens then follow it)."""
    return bool(index) and _tag_flags(index[0]) is not None


def _front_coded_ids(r: _Reader, sessions: list[SessionRecord], last_id: str) -> None:
    """Each session's id: the bytes it shares with the id before it (`last_id` for the
    first), then its own; at most 64 KiB an id and the segment's names budget in all."""
    before, budget = last_id.encode(), _names_limit(len(sessions))
    for rec in sessions:
        shared, size = r.varint(), r.varint()
        if shared > len(before) or shared + size > NAMES_BYTES_PER_SESSION:
            raise r.fail("a session name is longer than the name before it allows")
        name = before[:shared] + r.take(size)
        budget -= len(name)
        if not name or budget < 0:
            raise r.fail("a session has no name" if not name else "its session names are too long")
        try:
            rec.id = name.decode("utf-8")
        except UnicodeDecodeError:
            raise r.fail("a session name is not UTF-8") from None
        before = name


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
