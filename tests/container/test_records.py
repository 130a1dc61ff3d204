"""Format 1.6: every index record after the first is binary (docs/FORMAT.md, "Index records").

What an append costs beyond its sections, that a forged record with a valid checksum is
refused in one line, and that the derived pointer to the record before is checked."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from seqkv_cli.container import (
    CorruptContainerError,
    MalformedContainerError,
    append_sessions,
    open_container,
    write_container,
)
from seqkv_cli.container.format import (
    LAYOUT_RECORDS,
    LAYOUT_TABLES,
    REPLAY_MINOR,
    Slot,
    crc32c,
    encode_slot,
    encode_varint,
)
from seqkv_cli.errors import SeqkvError

HEADER = {"pipeline": [], "model": None, "sessions": [], "trie": {"version": 1}}


def trie_like(path: Path, turns: int, layout: int = LAYOUT_RECORDS) -> list[int]:
    """A file grown as a version-1 trie archive grows: an index and a tokens section a commit,
    no JSON sessions (a version-2 trie writes one section a commit)."""
    write_container(
        path, HEADER, [("t1/index", b"i" * 20), ("t1/tokens", b"t" * 60)], layout=layout
    )
    costs = []
    for k in range(2, turns + 2):
        sections = [(f"t{k}/index", b"i" * 20), (f"t{k}/tokens", b"t" * 60)]
        costs.append(append_sessions(path, [], sections).index_bytes)
    return costs


def test_a_trie_append_costs_a_few_dozen_bytes_of_index(tmp_path: Path) -> None:
    """The same appends to a 1.4 file cost ~100 bytes more each: its JSON part."""
    new = trie_like(tmp_path / "new.skv", 12)
    old = trie_like(tmp_path / "old.skv", 12, LAYOUT_TABLES)
    # varint J (0), varint length and CRC32C of the record before, two table rows
    assert max(new) <= 1 + 2 + 4 + 1 + (1 + 1 + 9 + 1 + 4) + (1 + 1 + 6 + 1 + 4)
    assert min(old) - max(new) >= 80
    with open_container(tmp_path / "new.skv") as container:
        assert container.version == (1, REPLAY_MINOR) and container.generation == 13
        for k in range(1, 14):
            assert container.read_section(f"t{k}/tokens") == b"t" * 60
        container.verify()
        regions = container.catalog.records
    assert all(a.end <= b.offset for a, b in itertools.pairwise(regions))


def test_flat_appends_keep_their_sessions(tmp_path: Path) -> None:
    path = tmp_path / "a.skv"
    write_container(path, dict(HEADER, sessions=[]), [])
    session = {"id": "s1", "positions": 3, "dtype": "bf16", "shapes": {}, "sections": ["s1/x"]}
    append_sessions(path, [session], [("s1/x", b"abc")])
    append_sessions(path, [], [])  # an empty commit: no sessions, no sections
    with open_container(path) as container:
        assert [s["id"] for s in container.header["sessions"]] == ["s1"]
        assert container.generation == 3
        assert container.read_section("s1/x") == b"abc"


def resign_newest(path: Path, mutate) -> None:
    """Give the newest record `mutate(raw)`, re-signed in its slot (the older slot, pointing
    at the record before, stays valid)."""
    data = path.read_bytes()
    with open_container(path) as container:
        slot = container.slot
    raw = mutate(data[slot.index_offset :])
    forged = Slot(slot.number, slot.generation, slot.index_offset, len(raw), crc32c(raw))
    at = 16 + 32 * slot.number
    head = bytearray(data[:80])
    head[at : at + 32] = encode_slot(data[:16], forged)
    path.write_bytes(bytes(head) + data[80 : slot.index_offset] + raw)


def table(*rows: tuple[int, bytes, int, int]) -> bytes:
    out = encode_varint(len(rows))
    for shared, suffix, length, crc in rows:
        out += encode_varint(shared) + encode_varint(len(suffix)) + suffix
        out += encode_varint(length) + crc.to_bytes(4, "little")
    return out


def good(path: Path) -> tuple[int, int, int, int]:
    """(previous length, previous CRC, CRC of t2/index, of t2/tokens) of a two-commit file."""
    with open_container(path) as container:
        first = container.catalog.records[0]
        entries = {s.name: s for s in container.sections}
    return first.length, first.crc32c, entries["t2/index"].crc32c, entries["t2/tokens"].crc32c


@pytest.mark.parametrize(
    ("forge", "error", "words"),
    [
        # the record before: one byte longer (its CRC then covers other bytes)
        (
            lambda n, c, a, b: (
                b"\x00"
                + encode_varint(n + 1)
                + c.to_bytes(4, "little")
                + table((0, b"t2/index", 20, a), (3, b"tokens", 60, b))
            ),
            CorruptContainerError,
            "record 1",
        ),
        # lengths that reach back before the data region
        (
            lambda n, c, a, b: (
                b"\x00"
                + encode_varint(n)
                + c.to_bytes(4, "little")
                + table((0, b"t2/index", 20 + 10**6, a), (3, b"tokens", 60, b))
            ),
            MalformedContainerError,
            "start before byte 80",
        ),
        # JSON with more than the sessions
        (
            lambda n, c, a, b: (
                encode_varint(29)
                + b'{"sessions":[],"generation":2}'[:29]
                + encode_varint(n)
                + c.to_bytes(4, "little")
            ),
            MalformedContainerError,
            "invalid index",
        ),
        (
            lambda n, c, a, b: (
                encode_varint(30)
                + b'{"sessions":[],"generation":2}'
                + encode_varint(n)
                + c.to_bytes(4, "little")
                + table((0, b"t2/index", 20, a), (3, b"tokens", 60, b))
            ),
            MalformedContainerError,
            "only 'sessions'",
        ),
        # an empty session list spelled out
        (
            lambda n, c, a, b: (
                encode_varint(15)
                + b'{"sessions":[]}'
                + encode_varint(n)
                + c.to_bytes(4, "little")
                + table((0, b"t2/index", 20, a), (3, b"tokens", 60, b))
            ),
            MalformedContainerError,
            "must list the sessions",
        ),
        # truncated inside the pointer, a table that does not cover the segment, trailing bytes
        (
            lambda n, c, a, b: b"\x00" + encode_varint(n) + b"\x01\x02",
            MalformedContainerError,
            "ends inside the CRC32C of the record before",
        ),
        (
            lambda n, c, a, b: (
                b"\x00"
                + encode_varint(n)
                + c.to_bytes(4, "little")
                + table((0, b"t2/index", 20, a))
            ),
            CorruptContainerError,
            "",
        ),
        (
            lambda n, c, a, b: (
                b"\x00"
                + encode_varint(n)
                + c.to_bytes(4, "little")
                + table((0, b"t2/index", 20, a), (3, b"tokens", 60, b))
                + b"\x00"
            ),
            MalformedContainerError,
            "follow the section table",
        ),
        (lambda n, c, a, b: b"\xff" * 12, MalformedContainerError, "longer than 9 bytes"),
    ],
)
def test_a_forged_binary_record_is_refused_in_one_line(tmp_path: Path, forge, error, words):
    path = tmp_path / "a.skv"
    trie_like(path, 1)
    resign_newest(path, lambda raw: forge(*good(path)))
    with pytest.raises(error) as info, open_container(path) as container:
        for s in container.sections:
            container.read_section(s.name)
    message = str(info.value)
    assert isinstance(info.value, SeqkvError) and "\n" not in message
    assert words in message


def test_the_forge_itself_reproduces_the_file(tmp_path: Path) -> None:
    """The record the forging tests start from is byte for byte what the writer wrote."""
    path = tmp_path / "a.skv"
    trie_like(path, 1)
    before = path.read_bytes()
    n, c, a, b = good(path)
    rebuilt = b"\x00" + encode_varint(n) + c.to_bytes(4, "little")
    rebuilt += table((0, b"t2/index", 20, a), (3, b"tokens", 60, b))
    resign_newest(path, lambda raw: rebuilt)
    assert path.read_bytes() == before
