"""Byte layout of the `.skv` superblock; `docs/FORMAT.md` is the prose version of this file.

The file starts with an 80-byte superblock: 16 bytes of preamble (magic, version, reserved)
and two 32-byte commit slots. Each slot points at the newest index record (JSON header and
section table) and is protected by a CRC32C that also covers the preamble. Writers only ever rewrite
the slot that is *not* current, so an interrupted commit can damage nothing the reader needs.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import google_crc32c

MAGIC = b"\x89SKV\r\n\x1a\n"
FORMAT_MAJOR = 1
# 1.1 added trie archives (header key "trie"), 1.2 the compact single-session layout
# (container/compact.py), 1.3 compact codes for the portable-fx53-v2 numeric path, 1.4 binary
# section tables in the full layout (index.py): a JSON row cost ~85 bytes a section, more than
# the residual parts of a foreign cache themselves; 1.5 compact codes for the portable-fx53-v3
# numeric path; 1.6 binary records after the first (index.py); 1.7 trie segments coded by
# another codec than the archive's (a "fast" turn in a `seq` archive, trie/tables.py); 1.8
# the compact archive layout (container/compact.py); 1.9 replay records in binary in a trie
# segment's table (trie/replay_records.py): as JSON a record cost ~300 bytes a turn.
# FORMAT_MINOR is the newest minor this seqkv reads; full-layout files are written as 1.9,
# appends keep the minor of the file they extend, compact single-session files take the
# oldest minor whose codes they use, compact archives 1.8 (1.9 where they hold a replay record).
FORMAT_MINOR = 9
FULL_LAYOUT_MINOR = 1  # JSON section tables, what seqkv before 0.4 writes and appends to
TABLES_MINOR = 4
RECORDS_MINOR = 6
SEGMENT_CODECS_MINOR = 7
REPLAY_MINOR = 9
# Byte 12 of a full-layout file: which encoding its index records use (1 is the compact
# layout). 1.6 keeps 1.4's first record and writes every later one in binary: an agent's turn
# appends a segment of a few dozen bytes of tokens, and 1.4's JSON part of a record (its
# generation and the pointer to the record before, as JSON) was more than those tokens.
LAYOUT_JSON, LAYOUT_TABLES, LAYOUT_RECORDS = 0, 2, 3
LAYOUT_MINOR = {  # the first minor of each layout (a preamble naming it with less is damaged)
    LAYOUT_JSON: FULL_LAYOUT_MINOR,
    LAYOUT_TABLES: TABLES_MINOR,
    LAYOUT_RECORDS: RECORDS_MINOR,
}

PREAMBLE = struct.Struct("<8sHHI")  # magic, major, minor, reserved (zero)
SLOT_BODY = struct.Struct("<QQQI")  # generation, index offset, index length, index crc
SLOT_SIZE = SLOT_BODY.size + 4  # + CRC32C of preamble and body
SLOT_OFFSETS = (PREAMBLE.size, PREAMBLE.size + SLOT_SIZE)
SUPERBLOCK_SIZE = PREAMBLE.size + 2 * SLOT_SIZE  # 80; the data region starts here
MAX_INDEX_BYTES = 16 * 1024 * 1024
CRC_CHUNK = 1 << 20  # bytes per google_crc32c call for buffers that are not `bytes`


def crc32c(data: bytes | bytearray | memoryview, crc: int = 0) -> int:
    """CRC32C of `data`, continuing from `crc` (google_crc32c accepts only `bytes` itself)."""
    if isinstance(data, bytes):
        return google_crc32c.extend(crc, data)
    view = memoryview(data).cast("B")
    for start in range(0, len(view), CRC_CHUNK):
        crc = google_crc32c.extend(crc, bytes(view[start : start + CRC_CHUNK]))
    return crc


@dataclass(frozen=True)
class Slot:
    """One commit slot: which index is current, and the checksum that index must have."""

    number: int
    generation: int
    index_offset: int
    index_length: int
    index_crc: int

    @property
    def committed_end(self) -> int:
        """File length at commit time; the index is always the last thing written."""
        return self.index_offset + self.index_length


def encode_preamble(layout: int = LAYOUT_RECORDS) -> bytes:
    """The 16 bytes a full-layout file starts with: 1.9 (binary records), 1.4 or 1.1.

    A nonzero byte 12 is what readers since 1.2 check before anything else, so an older seqkv
    refuses a layout it does not know as "written by a newer seqkv" instead of misreading it."""
    minor = REPLAY_MINOR if layout == LAYOUT_RECORDS else LAYOUT_MINOR[layout]
    return PREAMBLE.pack(MAGIC, FORMAT_MAJOR, minor, layout)


def full_layout(head: bytes) -> int | None:
    """The record encoding a full-layout preamble names (LAYOUT_*), None for any other."""
    minor, layout = int.from_bytes(head[10:12], "little"), head[12]
    if layout in (LAYOUT_TABLES, LAYOUT_RECORDS) and minor >= LAYOUT_MINOR[layout]:
        return layout
    return LAYOUT_JSON if layout == LAYOUT_JSON else None


class VarintError(Exception):
    """Internal: the data ends inside a varint (`truncated`), or it runs past its byte limit."""

    def __init__(self, truncated: bool) -> None:
        super().__init__("truncated" if truncated else "too long")
        self.truncated = truncated


def decode_varint(data: bytes, pos: int, max_bytes: int) -> tuple[int, int]:
    """(value, position after it) of the LEB128 varint at `data[pos]`, at most `max_bytes`.

    The codec library has its twin (seqkv_codecs.varint); the container keeps its own because
    it imports nothing beyond the standard library and google-crc32c (package docstring)."""
    value = shift = 0
    for i in range(max_bytes):
        if pos + i >= len(data):
            raise VarintError(truncated=True)
        byte = data[pos + i]
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos + i + 1
        shift += 7
    raise VarintError(truncated=False)


def encode_varint(value: int) -> bytes:
    """LEB128: 7 bits a byte, low first, high bit set on all but the last byte."""
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def encode_slot(preamble: bytes, slot: Slot) -> bytes:
    """The 32 bytes of a slot; its CRC covers the preamble so version flips are caught."""
    body = SLOT_BODY.pack(slot.generation, slot.index_offset, slot.index_length, slot.index_crc)
    return body + crc32c(preamble + body).to_bytes(4, "little")


def encode_superblock(slot: Slot, layout: int = LAYOUT_RECORDS) -> bytes:
    """A fresh superblock with `slot` filled in and the other slot empty (all zero)."""
    slots = [bytes(SLOT_SIZE), bytes(SLOT_SIZE)]
    preamble = encode_preamble(layout)
    slots[slot.number] = encode_slot(preamble, slot)
    return preamble + slots[0] + slots[1]


def decode_preamble(head: bytes) -> tuple[bytes, int, int, int]:
    """Split the first 16 bytes into magic, major, minor and the must-be-zero reserved word."""
    return PREAMBLE.unpack(head[: PREAMBLE.size])


def decode_slots(superblock: bytes) -> tuple[list[Slot], list[int]]:
    """Return the valid slots and the numbers of damaged ones; empty (all-zero) slots are neither.

    A slot is valid when its CRC matches and its generation is at least 1.
    """
    preamble = superblock[: PREAMBLE.size]
    valid: list[Slot] = []
    damaged: list[int] = []
    for number, offset in enumerate(SLOT_OFFSETS):
        raw = superblock[offset : offset + SLOT_SIZE]
        if raw == bytes(SLOT_SIZE):
            continue
        body, slot_crc = raw[: SLOT_BODY.size], int.from_bytes(raw[SLOT_BODY.size :], "little")
        generation, index_offset, index_length, index_crc = SLOT_BODY.unpack(body)
        if slot_crc != crc32c(preamble + body) or generation == 0:
            damaged.append(number)
            continue
        valid.append(Slot(number, generation, index_offset, index_length, index_crc))
    return valid, damaged
