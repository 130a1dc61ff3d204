"""Rewrite .skv files with valid checksums: what an attacker (or a buggy writer) can produce.

The CRCs only prove that bytes are what the writer wrote, so tests that probe the parsers
behind them take a real file apart, change a field and sign everything again. No schema
check runs here: the reader must stand on its own.
"""

from __future__ import annotations

from pathlib import Path

from seqkv_cli.container import open_container
from seqkv_cli.container.format import (
    LAYOUT_RECORDS,
    SUPERBLOCK_SIZE,
    Slot,
    crc32c,
    encode_superblock,
)
from seqkv_cli.container.index import IndexRecord, SectionEntry, encode_record


def take_apart(path: Path) -> tuple[dict, dict[str, bytes]]:
    """(header, {section name: bytes}) of a one-segment file."""
    with open_container(path) as reader:
        return reader.header, {s.name: reader.read_section(s.name) for s in reader.sections}


def put_together(header: dict, sections: dict[str, bytes]) -> bytes:
    """A one-segment file holding `sections` (in order) under `header`, freshly signed."""
    body, entries, offset = bytearray(), [], SUPERBLOCK_SIZE
    for name, data in sections.items():
        entries.append(SectionEntry(name, offset, len(data), crc32c(bytes(data))))
        body += data
        offset += len(data)
    raw = encode_record(IndexRecord(1, None, header, [], tuple(entries)), LAYOUT_RECORDS)
    slot = Slot(0, 1, offset, len(raw), crc32c(raw))
    return encode_superblock(slot) + bytes(body) + raw


def read_tables(data: bytes, first_node: int = 0):
    """A segment's tables with every session's end explicit, ready to change and re-encode."""
    from seqkv_cli.trie.tables import decode_tables

    found = decode_tables(data, first_node, "forge")
    for rec in found.sessions:
        if rec.end < 0:
            rec.end = found.nodes[rec.end_node - first_node].n_tokens
    return found
