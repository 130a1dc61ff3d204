"""Index records: the JSON that says where every byte of a segment is, chained across appends.

Each commit writes one segment: its sections, then one index record listing them. Record 1
holds the caller's header; record N > 1 holds the sessions that append added and a pointer
(offset, length, CRC32C) to record N - 1. Each record's sections must tile its segment exactly,
so with the chain of checksums every byte of a committed file is covered by some CRC32C, and
an append costs index bytes proportional to what it adds, not to what the file holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from seqkv_cli.container.format import SUPERBLOCK_SIZE
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


def encode_record(record: IndexRecord) -> bytes:
    """Serialise a record as the compact JSON object described in docs/FORMAT.md."""
    obj: dict[str, Any] = {"generation": record.generation}
    if record.previous is None:
        obj["header"] = record.header
    else:
        prev = record.previous
        obj["previous"] = {"offset": prev.offset, "length": prev.length, "crc32c": prev.crc32c}
        obj["sessions"] = record.sessions
    obj["sections"] = [
        {"name": s.name, "offset": s.offset, "length": s.length, "crc32c": s.crc32c}
        for s in record.sections
    ]
    return encode_json(obj)


def parse_record(raw: bytes, generation: int, where: Region) -> IndexRecord:
    """Decode one record found at `where` (CRC already checked) and check its segment."""
    obj = decode_json(raw)
    if not isinstance(obj, dict):
        raise SchemaViolation("an index record must be a JSON object")
    found = obj.get("generation")
    if found != generation or isinstance(found, bool):
        raise SchemaViolation(f"index record says generation {found!r}, expected {generation}")
    rows = obj.get("sections")
    if not isinstance(rows, list):
        raise SchemaViolation("an index record's 'sections' must be a list")
    sections = tuple(_section(row) for row in rows)
    if generation == 1:
        record = IndexRecord(1, None, obj.get("header"), [], sections)
        start = SUPERBLOCK_SIZE
    else:
        previous = _region(obj.get("previous"))
        sessions = obj.get("sessions")
        if not isinstance(sessions, list):
            raise SchemaViolation(f"index record {generation} must list the sessions it adds")
        if previous.end > where.offset:
            raise SchemaViolation(f"index record {generation} points forward to its predecessor")
        record = IndexRecord(generation, previous, None, sessions, sections)
        start = previous.end
    _check_tiling(sections, start, where.offset, generation)
    return record


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
