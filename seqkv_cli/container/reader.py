"""Open an `.skv` file and read sections on demand, checking every byte it hands out.

Nothing is allocated before it is justified: lengths come from a CRC-checked slot or index
and are compared with the real file size first, and sections are read with seek/read only
when asked for, so a multi-gigabyte archive opens in constant memory.
"""

from __future__ import annotations

import os
from typing import Any

from seqkv_cli.container.compact import COMPACT_MINOR, is_compact
from seqkv_cli.container.compact_reader import CompactReader
from seqkv_cli.container.errors import (
    CorruptContainerError,
    HeaderTooLargeError,
    MalformedContainerError,
    NotAContainerError,
    SectionCorruptError,
    SectionNotFoundError,
    TruncatedContainerError,
    UnsupportedVersionError,
)
from seqkv_cli.container.format import (
    CRC_CHUNK,
    FORMAT_MAJOR,
    FORMAT_MINOR,
    LAYOUT_JSON,
    MAGIC,
    MAX_INDEX_BYTES,
    PREAMBLE,
    SUPERBLOCK_SIZE,
    Slot,
    crc32c,
    decode_preamble,
    decode_slots,
    full_layout,
)
from seqkv_cli.container.index import (
    Catalog,
    IndexRecord,
    Region,
    SectionEntry,
    merge_records,
    parse_record,
)
from seqkv_cli.container.openfile import OpenFile
from seqkv_cli.container.schema import SchemaViolation


class ContainerReader(OpenFile):
    """A validated, open `.skv` file; use as a context manager or call `close()`."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__(path)
        try:
            self._load()
        except BaseException:
            self._file.close()
            raise

    def _load(self) -> None:
        head = self._read_at(0, min(self.size, SUPERBLOCK_SIZE))
        if len(head) < len(MAGIC):
            raise NotAContainerError(self.path, f"too short to be an .skv file ({self.size} bytes)")
        if not head.startswith(MAGIC):
            shown = head[: len(MAGIC)].hex(" ") or "nothing"
            raise NotAContainerError(self.path, f"not an .skv file (it starts with {shown})")
        if len(head) < PREAMBLE.size:
            raise TruncatedContainerError(self.path, "the file ends inside its superblock")
        _, major, minor, _ = decode_preamble(head)
        self.version = (major, minor)
        if major > FORMAT_MAJOR:
            raise UnsupportedVersionError(
                self.path, f"written by a newer seqkv (format {major}.{minor}); upgrade seqkv"
            )
        if major < FORMAT_MAJOR:
            raise UnsupportedVersionError(
                self.path, f"format {major}.{minor} is unknown; this seqkv reads {FORMAT_MAJOR}.x"
            )
        # byte 12 names a layout from 1.2 on (before, it was reserved and never read); the full
        # layout's index records are JSON, JSON + binary tables (1.4) or binary records (1.6)
        layout = full_layout(head) if minor >= COMPACT_MINOR else LAYOUT_JSON
        if layout is None:
            if minor > FORMAT_MINOR:
                raise UnsupportedVersionError(
                    self.path, f"written by a newer seqkv (format {major}.{minor}); upgrade seqkv"
                )
            what = "compact" if is_compact(head) else f"unknown ({head[12]})"
            raise UnsupportedVersionError(
                self.path, f"its layout is {what}, not the full container layout read here"
            )
        self.layout = layout
        self.tables = layout != LAYOUT_JSON
        if len(head) < SUPERBLOCK_SIZE:
            raise TruncatedContainerError(self.path, "the file ends inside its superblock")
        valid, damaged = decode_slots(head)
        self.damaged_slots = tuple(damaged)
        slot = self._choose_slot(valid)
        self.preamble = head[: PREAMBLE.size]
        self.slot = slot
        self.catalog = self._load_catalog(slot)
        self.uncommitted_bytes = self.size - slot.committed_end
        self._by_name = {entry.name: entry for entry in self.catalog.sections}
        older = [s for s in valid if s is not slot]
        if older and not self._consistent(older[0]):
            raise CorruptContainerError(
                self.path, f"superblock slot {older[0].number} disagrees with the current index"
            )

    def _choose_slot(self, valid: list[Slot]) -> Slot:
        """The newest valid slot; a damaged slot is tolerated here and reported by verify()."""
        if not valid:
            what = "are damaged" if self.damaged_slots else "are empty (never committed)"
            raise CorruptContainerError(self.path, f"both superblock commit slots {what}")
        if len(valid) == 2 and valid[0].generation == valid[1].generation:
            raise CorruptContainerError(self.path, "both superblock slots claim one generation")
        slot = max(valid, key=lambda s: s.generation)
        if slot.index_offset < SUPERBLOCK_SIZE:
            raise CorruptContainerError(self.path, "the commit slot points into the superblock")
        return slot

    def _load_catalog(self, slot: Slot) -> Catalog:
        """Walk the record chain from the newest back to the first, checking each CRC32C."""
        records: list[IndexRecord] = []
        regions: list[Region] = []
        where: Region | None = Region(slot.index_offset, slot.index_length, slot.index_crc)
        generation = slot.generation
        while where is not None:
            if where.length > MAX_INDEX_BYTES:
                raise HeaderTooLargeError(
                    self.path,
                    f"index record {generation} is {where.length} bytes, "
                    f"over the {MAX_INDEX_BYTES}-byte cap",
                )
            if where.end > self.size:
                raise TruncatedContainerError(
                    self.path,
                    f"truncated: {self.size} bytes, but {where.end} were committed; "
                    "copy the file again",
                )
            raw = self._read_at(where.offset, where.length)
            if crc32c(raw) != where.crc32c:
                raise CorruptContainerError(
                    self.path, f"the header/index (record {generation}) checksum does not match"
                )
            try:
                record = parse_record(raw, generation, where, self.layout)
            except SchemaViolation as error:
                raise MalformedContainerError(self.path, f"invalid index: {error}") from None
            records.append(record)
            regions.append(where)
            where, generation = record.previous, generation - 1
        try:
            return merge_records(records[::-1], regions[::-1])
        except SchemaViolation as error:
            raise MalformedContainerError(self.path, f"invalid index: {error}") from None

    def _consistent(self, older: Slot) -> bool:
        """The older slot must point at the record that the current one follows."""
        previous = self.catalog.records[-2] if len(self.catalog.records) > 1 else None
        return older.generation == self.slot.generation - 1 and previous == Region(
            older.index_offset, older.index_length, older.index_crc
        )

    @property
    def generation(self) -> int:
        """How many commits (the first write plus appends) the file has seen."""
        return self.slot.generation

    @property
    def index_bytes(self) -> int:
        """Bytes of all index records (JSON header and section tables), for overhead reports."""
        return sum(region.length for region in self.catalog.records)

    @property
    def header(self) -> dict[str, Any]:
        """The header dict exactly as the writer was given it (do not mutate)."""
        return self.catalog.header

    @property
    def sections(self) -> list[SectionEntry]:
        """Section entries in file order."""
        return list(self.catalog.sections)

    def read_section(self, name: str) -> bytes:
        """Return one section's bytes after checking its CRC32C."""
        entry = self._by_name.get(name)
        if entry is None:
            raise SectionNotFoundError(
                self.path, f"no section named {name!r} ({len(self._by_name)} sections in file)"
            )
        data = self._read_at(entry.offset, entry.length)
        if crc32c(data) != entry.crc32c:
            raise SectionCorruptError(
                self.path, name, f"section {name!r} is corrupt (checksum mismatch)"
            )
        return data

    def verify(self) -> None:
        """Check every section's CRC32C (streamed) and report a damaged superblock slot."""
        for entry in self.catalog.sections:
            if self._stream_crc(entry.offset, entry.length) != entry.crc32c:
                raise SectionCorruptError(
                    self.path, entry.name, f"section {entry.name!r} is corrupt (checksum mismatch)"
                )
        if self.damaged_slots:
            raise CorruptContainerError(
                self.path,
                f"superblock slot {self.damaged_slots[0]} is damaged; the data read fine, but "
                "the latest append may be lost: restore the file from a copy",
            )

    def _stream_crc(self, offset: int, length: int) -> int:
        crc = 0
        for start in range(offset, offset + length, CRC_CHUNK):
            crc = crc32c(self._read_at(start, min(CRC_CHUNK, offset + length - start)), crc)
        return crc


def open_container(path: str | os.PathLike[str]) -> ContainerReader | CompactReader:
    """Open and validate an `.skv` file (superblock, index, tiling); sections load lazily.

    A compact file (a single session, format 1.2, or a compact archive, 1.8) opens as a
    CompactReader, which answers the same questions (header, sections, read_section, verify).
    """
    try:
        with open(path, "rb") as file:
            head = file.read(PREAMBLE.size)
    except OSError:
        head = b""  # ContainerReader names the problem
    if head.startswith(MAGIC) and is_compact(head):
        return CompactReader(path)
    return ContainerReader(path)
