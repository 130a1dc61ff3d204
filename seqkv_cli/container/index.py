"""Index records: the JSON that says where every byte of a segment is, chained across appends.

Each commit writes one segment: its sections, then one index record listing them. Record 1
holds the caller's header; record N > 1 holds the sessions that append added and a pointer
(offset, length, CRC32C) to record N - 1. Each record's sections must tile its segment exactly,
so with the chain of checksums every byte of a committed file is covered by some CRC32C, and
an append costs index bytes proportional to what it adds, not to what the file holds.

Three encodings of a record (docs/FORMAT.md, "Index records"), named by the file's layout
byte: JSON with a JSON section table (format 1.1, the `tables=False` case); from 1.4 the same
JSON without `sections`, then a binary section table (names front-coded against the row
before, offsets implied by the tiling, so a row costs ~10 bytes instead of ~85); and from 1.6
every record after the first in binary too: the pointer to the record before is its length
and CRC32C (its offset follows from the tiling), the generation is the record's place in the
chain, and JSON is there only for the sessions a flat append adds. A trie append (one agent
turn) then costs a few dozen bytes of index instead of ~130.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from seqkv_cli.container.format import (
    LAYOUT_JSON,
    LAYOUT_RECORDS,
    SUPERBLOCK_SIZE,
    VarintError,
    decode_varint,
    encode_varint,
)
from seqkv_cli.container.schema import (
    SchemaViolation,
    check_header,
    check_section_name,
    decode_json,
    encode_json,
)


@dataclass(frozen=True)
class Region:
    """A checksummed byte range: where an index record lies and the CRC32C it must have."""

    offset: int
    length: int
    crc32c: int

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True)
class SectionEntry:
    """One named section: where its payload lies and the CRC32C it must have."""

    name: str
    offset: int
    length: int
    crc32c: int


@dataclass(frozen=True)
class IndexRecord:
    """One on-disk index: generation 1 carries `header`, later ones the `sessions` they add."""

    generation: int
    previous: Region | None
    header: dict[str, Any] | None
    sessions: list[Any] = field(default_factory=list)
    sections: tuple[SectionEntry, ...] = ()


@dataclass(frozen=True)
class Catalog:
    """The whole chain merged: what the file holds at its current generation."""

    generation: int
    header: dict[str, Any]
    sections: tuple[SectionEntry, ...]
    records: tuple[Region, ...]  # every index record, oldest first


JSON_LENGTH_BYTES = 4  # a binary-table record starts with its JSON part's length (u32)
ROW_MIN_BYTES = 4 + 4  # four varints of one byte and a CRC32C: the smallest row


def encode_record(record: IndexRecord, layout: int = LAYOUT_JSON) -> bytes:
    """Serialise a record as docs/FORMAT.md describes for the file's `layout` (LAYOUT_*)."""
    if layout == LAYOUT_RECORDS and record.previous is not None:
        return _binary_record(record)
    obj: dict[str, Any] = {"generation": record.generation}
    if record.previous is None:
        obj["header"] = record.header
    else:
        prev = record.previous
        obj["previous"] = {"offset": prev.offset, "length": prev.length, "crc32c": prev.crc32c}
        obj["sessions"] = record.sessions
    if layout != LAYOUT_JSON:
        head = encode_json(obj)
        start = SUPERBLOCK_SIZE if record.previous is None else record.previous.end
        return len(head).to_bytes(JSON_LENGTH_BYTES, "little") + head + _table(record, start)
    obj["sections"] = [
        {"name": s.name, "offset": s.offset, "length": s.length, "crc32c": s.crc32c}
        for s in record.sections
    ]
    return encode_json(obj)


def _binary_record(record: IndexRecord) -> bytes:
    """Record N > 1 of a 1.6 file: [varint J, J bytes of JSON {"sessions": [...]}] (J = 0:
    none), varint length and u32 CRC32C of record N - 1, then the binary section table."""
    head = encode_json({"sessions": record.sessions}) if record.sessions else b""
    prev = record.previous
    assert prev is not None
    out = encode_varint(len(head)) + head + encode_varint(prev.length)
    return out + prev.crc32c.to_bytes(4, "little") + _table(record, prev.end)


def _table(record: IndexRecord, start: int) -> bytes:
    """Rows in file order: shared name prefix, the rest of the name, length, CRC32C."""
    out = bytearray(encode_varint(len(record.sections)))
    before, cursor = b"", start
    for s in sorted(record.sections, key=lambda s: s.offset):
        if s.offset != cursor:  # offsets are implied, so they must follow from the tiling
            raise SchemaViolation(f"section {s.name!r} does not start where the one before ends")
        name = s.name.encode("utf-8")
        shared = shared_prefix(before, name)
        out += encode_varint(shared) + encode_varint(len(name) - shared) + name[shared:]
        out += encode_varint(s.length) + s.crc32c.to_bytes(4, "little")
        before, cursor = name, cursor + s.length
    return bytes(out)


def shared_prefix(a: bytes, b: bytes) -> int:
    """Bytes `a` and `b` share at their start (front coding: here, and trie session ids)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def parse_record(
    raw: bytes, generation: int, where: Region, layout: int = LAYOUT_JSON
) -> IndexRecord:
    """Decode one record found at `where` (CRC already checked) and check its segment."""
    if layout == LAYOUT_RECORDS and generation > 1:
        return _parse_binary_record(raw, generation, where)
    table = None
    if layout != LAYOUT_JSON:
        if len(raw) < JSON_LENGTH_BYTES:
            raise SchemaViolation("an index record is shorter than its JSON length field")
        size = int.from_bytes(raw[:JSON_LENGTH_BYTES], "little")
        if size > len(raw) - JSON_LENGTH_BYTES:
            raise SchemaViolation(f"an index record's JSON part ({size} bytes) runs past its end")
        table = raw[JSON_LENGTH_BYTES + size :]
        raw = raw[JSON_LENGTH_BYTES : JSON_LENGTH_BYTES + size]
    obj = decode_json(raw)
    if not isinstance(obj, dict):
        raise SchemaViolation("an index record must be a JSON object")
    found = obj.get("generation")
    if found != generation or isinstance(found, bool):
        raise SchemaViolation(f"index record says generation {found!r}, expected {generation}")
    if generation == 1:
        previous, start = None, SUPERBLOCK_SIZE
    else:
        previous = _region(obj.get("previous"))
        if previous.end > where.offset:
            raise SchemaViolation(f"index record {generation} points forward to its predecessor")
        start = previous.end
    if table is None:
        rows = obj.get("sections")
        if not isinstance(rows, list):
            raise SchemaViolation("an index record's 'sections' must be a list")
        sections = tuple(_section(row) for row in rows)
    else:
        if "sections" in obj:
            raise SchemaViolation("a record with a binary section table also lists 'sections'")
        sections = _parse_table(table, start)
    if previous is None:
        record = IndexRecord(1, None, obj.get("header"), [], sections)
    else:
        sessions = obj.get("sessions")
        if not isinstance(sessions, list):
            raise SchemaViolation(f"index record {generation} must list the sessions it adds")
        record = IndexRecord(generation, previous, None, sessions, sections)
    _check_tiling(sections, start, where.offset, generation)
    return record


def _parse_binary_record(raw: bytes, generation: int, where: Region) -> IndexRecord:
    """Record N > 1 of a 1.6 file (see `_binary_record`): its segment ends where the record
    starts, so the table's lengths say where the segment, and record N - 1, end."""
    data = _Table(raw, "index record")
    size = data.varint("its JSON length")
    sessions: list[Any] = []
    if size:
        obj = decode_json(data.take(size, "its JSON part"))
        if not isinstance(obj, dict) or set(obj) != {"sessions"}:
            raise SchemaViolation(f"index record {generation}'s JSON must hold only 'sessions'")
        sessions = obj["sessions"]
        if not isinstance(sessions, list) or not sessions:
            raise SchemaViolation(f"index record {generation} must list the sessions it adds")
    length = data.varint("the length of the record before")
    crc = int.from_bytes(data.take(4, "the CRC32C of the record before"), "little")
    relative = _parse_table(raw[data.pos :], 0)
    start = where.offset - sum(s.length for s in relative)
    if start - length < SUPERBLOCK_SIZE:
        raise SchemaViolation(
            f"index record {generation}'s segment and the record before start before byte "
            f"{SUPERBLOCK_SIZE}"
        )
    sections = tuple(SectionEntry(s.name, s.offset + start, s.length, s.crc32c) for s in relative)
    previous = Region(start - length, length, crc)
    _check_tiling(sections, start, where.offset, generation)
    return IndexRecord(generation, previous, None, sessions, sections)


class _Table:
    """Bounded reads of a binary section table or record: nothing runs past its bytes."""

    def __init__(self, data: bytes, kind: str = "section table") -> None:
        self.data, self.pos, self.kind = data, 0, kind

    def varint(self, what: str) -> int:
        try:  # 9 bytes, 63 bits: every count, length and offset of the format fits
            value, self.pos = decode_varint(self.data, self.pos, 9)
        except VarintError as error:
            if error.truncated:
                raise SchemaViolation(f"the {self.kind} ends inside {what}") from None
            raise SchemaViolation(f"the {self.kind}'s {what} is longer than 9 bytes") from None
        return value

    def take(self, n: int, what: str) -> bytes:
        if n > len(self.data) - self.pos:
            raise SchemaViolation(f"the {self.kind} ends inside {what}")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out


def _parse_table(data: bytes, start: int) -> tuple[SectionEntry, ...]:
    table = _Table(data)
    count = table.varint("its row count")
    if count > len(data) // ROW_MIN_BYTES:
        raise SchemaViolation(f"the section table claims {count} rows in {len(data)} bytes")
    rows, before, offset = [], b"", start
    for i in range(count):
        shared = table.varint(f"row {i}")
        if shared > len(before):
            raise SchemaViolation(f"row {i} shares {shared} name bytes; the name before has fewer")
        name = before[:shared] + table.take(table.varint(f"row {i}"), f"row {i}'s name")
        length = table.varint(f"row {i}'s length")
        crc = int.from_bytes(table.take(4, f"row {i}'s CRC32C"), "little")
        try:
            text = name.decode("utf-8")
        except UnicodeDecodeError:
            raise SchemaViolation(f"row {i}'s section name is not UTF-8") from None
        check_section_name(text)
        rows.append(SectionEntry(text, offset, length, crc))
        before, offset = name, offset + length
    if table.pos != len(data):
        raise SchemaViolation(f"{len(data) - table.pos} bytes follow the section table's rows")
    return tuple(rows)


def merge_records(records: list[IndexRecord], regions: list[Region]) -> Catalog:
    """Combine records (oldest first) into one header and one section table, then check it."""
    first = records[0]
    if not isinstance(first.header, dict):
        raise SchemaViolation("the first index record has no header object")
    if not isinstance(first.header.get("sessions"), list):
        raise SchemaViolation("header['sessions'] must be a list of session dicts")
    sessions = list(first.header["sessions"])
    for record in records[1:]:
        sessions += record.sessions
    header = first.header if len(records) == 1 else dict(first.header, sessions=sessions)
    sections = tuple(s for record in records for s in record.sections)
    names = [s.name for s in sections]
    if len(set(names)) != len(names):
        duplicate = next(n for n in names if names.count(n) > 1)
        raise SchemaViolation(f"section name {duplicate!r} appears twice")
    check_header(header, set(names), strict=False)
    return Catalog(records[-1].generation, header, sections, tuple(regions))


def _region(item: Any) -> Region:
    """One table row's offset, length and CRC32C, each checked to be a sane integer."""
    if not isinstance(item, dict):
        raise SchemaViolation("a section table row or record pointer is not a JSON object")
    values = []
    for key, limit in (("offset", 1 << 63), ("length", 1 << 63), ("crc32c", 1 << 32)):
        value = item.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < limit:
            raise SchemaViolation(f"a section table row has a bad {key!r}: {value!r}")
        values.append(value)
    return Region(*values)


def _section(item: Any) -> SectionEntry:
    region = _region(item)
    check_section_name(item.get("name"))
    return SectionEntry(item["name"], region.offset, region.length, region.crc32c)


def _check_tiling(
    sections: tuple[SectionEntry, ...], start: int, stop: int, generation: int
) -> None:
    """A record's sections must cover its segment [start, stop) exactly: no holes, no overlap."""
    cursor = start
    for s in sorted(sections, key=lambda s: (s.offset, s.length)):
        if s.offset + s.length > stop:
            raise SchemaViolation(
                f"section {s.name!r} (offset {s.offset}, length {s.length}) points past the "
                f"end of its segment at {stop}"
            )
        if s.offset > cursor:
            raise SchemaViolation(f"bytes {cursor}..{s.offset} belong to no section (a hole)")
        if s.offset < cursor:
            raise SchemaViolation(f"section {s.name!r} overlaps the bytes before it")
        cursor += s.length
    if cursor != stop:
        raise SchemaViolation(
            f"bytes {cursor}..{stop} before index record {generation} belong to no section"
        )
