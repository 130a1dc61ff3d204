"""The `.skv` container: round trips, every error class, atomic writes and crash-safe appends."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from seqkv_cli.container import (
    MAX_INDEX_BYTES,
    ContainerError,
    ContainerWriteError,
    ContainerWriter,
    CorruptContainerError,
    HeaderTooLargeError,
    InvalidContainerInputError,
    MalformedContainerError,
    NotAContainerError,
    SectionCorruptError,
    SectionNotFoundError,
    TruncatedContainerError,
    UnsupportedVersionError,
    append_sessions,
    open_container,
    write_container,
)
from seqkv_cli.container.format import (
    FORMAT_MINOR,
    FULL_LAYOUT_MINOR,
    LAYOUT_JSON,
    LAYOUT_RECORDS,
    LAYOUT_TABLES,
    REPLAY_MINOR,
    SLOT_OFFSETS,
    SUPERBLOCK_SIZE,
    TABLES_MINOR,
    Slot,
    crc32c,
    decode_varint,
    encode_slot,
    encode_varint,
)
from seqkv_cli.errors import SeqkvError

BIG = np.random.default_rng(7).bytes(3 * 1024 * 1024 + 17)


def session(sid: str, names: list[str], positions: int = 4) -> dict[str, Any]:
    return {
        "id": sid,
        "positions": positions,
        "dtype": "bfloat16",
        "shapes": {"key": [30, 3, positions, 64]},
        "sections": names,
    }


def sample() -> tuple[dict[str, Any], list[tuple[str, bytes]]]:
    """Three sessions, an empty section, a 3 MB section, unicode names, a shared section."""
    sections = [
        ("s0/tokens", b"\x01\x02\x03\x04"),
        ("s0/layers.0.key", bytes(range(256)) * 3),
        ("s1/ключ.3", b""),
        ("s1/鍵🔑", BIG),
        ("s2/tokens", b"tail"),
        ("shared/trie", b"trie-bytes"),
    ]
    header = {
        "pipeline": [{"id": "token-ac", "precision": 24}, {"id": "zstd", "level": 19}],
        "model": {"fingerprint": "sha256:abc", "name": "SmolLM2-135M", "layers": 30},
        "sessions": [
            session("s0", ["s0/tokens", "s0/layers.0.key", "shared/trie"]),
            session("s1", ["s1/ключ.3", "s1/鍵🔑", "shared/trie"]),
            session("s2", ["s2/tokens"], positions=0),
        ],
        "meta": {"seqkv": "0.1.0", "ratio": 0.1, "neg": -0.0, "big": 2**70, "none": None},
    }
    return header, sections


SAMPLE_BYTES = sum(len(data) for _, data in sample()[1])


def write_sample(path: Path, tables: bool = True) -> tuple[dict[str, Any], list[tuple[str, bytes]]]:
    header, sections = sample()
    write_container(path, header, sections, tables=tables)
    return header, sections


def expect(error: type[ContainerError], fn: Callable[[], Any], *words: str) -> ContainerError:
    """Run fn, demand `error`, and check the message is one line naming the problem."""
    with pytest.raises(error) as info:
        fn()
    message = str(info.value)
    assert isinstance(info.value, SeqkvError)
    assert "\n" not in message
    for word in words:
        assert word in message, (word, message)
    return info.value


def open_all(path: Path) -> None:
    with open_container(path) as container:
        container.verify()
        for entry in container.sections:
            container.read_section(entry.name)


def rewrite_first_record(path: Path, mutate: Callable[[dict[str, Any]], Any]) -> None:
    """Re-encode index record 1 of a one-segment 1.1 file with a valid CRC (a crafted file)."""
    data = path.read_bytes()
    with open_container(path) as container:
        slot = container.slot
    record = json.loads(data[slot.index_offset :])
    new = mutate(record)
    raw = new if isinstance(new, bytes) else json.dumps(record).encode()
    forged = Slot(0, 1, slot.index_offset, len(raw), crc32c(raw))
    head = data[:16] + encode_slot(data[:16], forged) + data[48:80]
    path.write_bytes(head + data[80 : slot.index_offset] + raw)


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


# --- round trips -------------------------------------------------------------------------


LAYOUTS = [
    (LAYOUT_RECORDS, REPLAY_MINOR),  # new full-layout files: 1.9 (1.8 is compact)
    (LAYOUT_TABLES, TABLES_MINOR),
    (LAYOUT_JSON, FULL_LAYOUT_MINOR),
]


@pytest.mark.parametrize(("layout", "minor"), LAYOUTS)
def test_round_trip_is_exact(tmp_path: Path, layout: int, minor: int) -> None:
    header, sections = sample()
    path = tmp_path / "a.skv"
    tables = layout != LAYOUT_JSON
    result = write_container(path, header, sections, layout=layout)
    assert result.file_bytes == path.stat().st_size
    assert result.section_bytes == sum(len(d) for _, d in sections)
    assert result.generation == 1
    assert leftovers(tmp_path) == ["a.skv"]
    with open_container(path) as container:
        assert container.version == (1, minor)
        assert container.tables is tables and container.layout == layout
        assert container.generation == 1
        assert json.dumps(container.header) == json.dumps(header)  # same values, same order
        assert container.header["meta"]["big"] == 2**70
        assert [e.name for e in container.sections] == [name for name, _ in sections]
        assert container.index_bytes == result.index_bytes
        assert SUPERBLOCK_SIZE + result.section_bytes + result.index_bytes == result.file_bytes
        for name, data in sections:
            assert container.read_section(name) == data
        container.verify()
        assert container.uncommitted_bytes == 0
        assert container.damaged_slots == ()


def test_sections_tile_the_data_region(tmp_path: Path) -> None:
    write_sample(tmp_path / "a.skv")
    with open_container(tmp_path / "a.skv") as container:
        cursor = SUPERBLOCK_SIZE
        for entry in container.sections:
            assert entry.offset == cursor
            cursor += entry.length
        assert cursor == container.slot.index_offset


def test_accepts_any_contiguous_buffer(tmp_path: Path) -> None:
    array = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    payloads = [("a", bytearray(b"xyz")), ("b", memoryview(b"0123456789")[2:7]), ("c", array)]
    header = {"pipeline": [], "model": None, "sessions": []}
    write_container(tmp_path / "b.skv", header, payloads)
    with open_container(tmp_path / "b.skv") as container:
        assert container.read_section("a") == b"xyz"
        assert container.read_section("b") == b"23456"
        got = np.frombuffer(container.read_section("c"), dtype=np.float32).reshape(2, 3, 4)
        np.testing.assert_array_equal(got, array)


def test_writer_streams_sections_from_a_generator(tmp_path: Path) -> None:
    chunks = (bytes([i]) * 100_000 for i in range(20))
    path = tmp_path / "s.skv"
    with ContainerWriter(path) as writer:
        for i, chunk in enumerate(chunks):
            entry = writer.add_section(f"s0/part{i}", chunk)
            assert entry.length == 100_000
        result = writer.finish(
            {"pipeline": [], "model": None, "sessions": [session("s0", ["s0/part19"])]}
        )
    assert result.section_bytes == 2_000_000
    with open_container(path) as container:
        assert container.read_section("s0/part7") == bytes([7]) * 100_000


# --- errors while reading ----------------------------------------------------------------


def test_not_a_container(tmp_path: Path) -> None:
    zip_like = tmp_path / "x.skv"
    zip_like.write_bytes(b"PK\x03\x04" + bytes(200))
    expect(NotAContainerError, lambda: open_container(zip_like), str(zip_like), "not an .skv")
    empty = tmp_path / "empty.skv"
    empty.write_bytes(b"")
    expect(NotAContainerError, lambda: open_container(empty), "too short", "0 bytes")
    expect(ContainerError, lambda: open_container(tmp_path / "nope.skv"), "cannot open")


def test_newer_major_version_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "a.skv"
    write_sample(path)
    data = bytearray(path.read_bytes())
    data[8:12] = struct.pack("<HH", 2, 3)
    path.write_bytes(bytes(data))
    expect(
        UnsupportedVersionError,
        lambda: open_container(path),
        "written by a newer seqkv (format 2.3); upgrade seqkv",
    )
    data[8:10] = struct.pack("<H", 0)
    path.write_bytes(bytes(data))
    expect(UnsupportedVersionError, lambda: open_container(path), "format 0.3 is unknown")


@pytest.mark.parametrize("layout", [LAYOUT_JSON, LAYOUT_TABLES, LAYOUT_RECORDS])
def test_newer_minor_version_is_read_but_not_appended_to(tmp_path: Path, layout: int) -> None:
    path = tmp_path / "a.skv"
    write_container(path, *sample(), layout=layout)
    data = path.read_bytes()
    newer = FORMAT_MINOR + 1
    preamble = data[:8] + struct.pack("<HHI", 1, newer, layout)
    with open_container(path) as container:
        slot = container.slot
    path.write_bytes(preamble + encode_slot(preamble, slot) + data[48:])
    with open_container(path) as container:
        assert container.version == (1, newer)
        assert container.read_section("s1/鍵🔑") == BIG
    before = path.read_bytes()
    expect(
        UnsupportedVersionError,
        lambda: append_sessions(path, [session("s9", [])], []),
        f"format 1.{newer}",
        "upgrade seqkv",
    )
    assert path.read_bytes() == before


def test_truncated_file(tmp_path: Path) -> None:
    path = tmp_path / "a.skv"
    write_sample(path)
    data = path.read_bytes()
    for size in (len(data) - 1, len(data) // 2, 100, 40, 12):
        path.write_bytes(data[:size])
        expect(TruncatedContainerError, lambda: open_container(path), "truncated")


def test_index_over_the_cap_is_refused_before_reading(tmp_path: Path) -> None:
    path = tmp_path / "a.skv"
    write_sample(path)
    data = path.read_bytes()
    huge = Slot(0, 1, 80, MAX_INDEX_BYTES + 1, 0)
    path.write_bytes(data[:16] + encode_slot(data[:16], huge) + data[48:])
    expect(HeaderTooLargeError, lambda: open_container(path), "16777216-byte cap")


def test_writer_refuses_an_index_over_the_cap(tmp_path: Path) -> None:
    header = {"pipeline": [], "model": None, "sessions": [], "meta": {"x": "a" * MAX_INDEX_BYTES}}
    path = tmp_path / "big.skv"
    expect(HeaderTooLargeError, lambda: write_container(path, header, []), "over the")
    assert leftovers(tmp_path) == []


def test_header_checksum_mismatch(tmp_path: Path) -> None:
    path = tmp_path / "a.skv"
    write_sample(path)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x20
    path.write_bytes(bytes(data))
    expect(CorruptContainerError, lambda: open_container(path), "header/index", "checksum")


def test_section_checksum_mismatch_names_the_section(tmp_path: Path) -> None:
    path = tmp_path / "a.skv"
    write_sample(path)
    with open_container(path) as container:
        target = next(e for e in container.sections if e.name == "s1/鍵🔑")
    data = bytearray(path.read_bytes())
    data[target.offset + 12345] ^= 0x01
    path.write_bytes(bytes(data))
    with open_container(path) as container:
        error = expect(SectionCorruptError, lambda: container.read_section("s1/鍵🔑"), "'s1/鍵🔑'")
        assert error.section == "s1/鍵🔑"
        expect(SectionCorruptError, container.verify, "'s1/鍵🔑'", "corrupt")
        assert container.read_section("s2/tokens") == b"tail"  # the rest stays readable


def test_unknown_section_name(tmp_path: Path) -> None:
    write_sample(tmp_path / "a.skv")
    with open_container(tmp_path / "a.skv") as container:
        error = expect(SectionNotFoundError, lambda: container.read_section("s7/x"), "'s7/x'")
        assert isinstance(error, LookupError)


@pytest.mark.parametrize(
    ("mutate", "words"),
    [
        (lambda r: r["sections"][1].update(length=r["sections"][1]["length"] + 10**9), "past"),
        (
            lambda r: r["sections"][4].update(offset=r["sections"][4]["offset"] + 1, length=3),
            "hole",
        ),
        (lambda r: r["sections"][4].update(offset=r["sections"][4]["offset"] - 1), "overlaps"),
        (lambda r: r["sections"][2].update(name="s0/tokens"), "appears twice"),
        (lambda r: r["sections"][0].update(crc32c=-1), "bad 'crc32c'"),
        (lambda r: r["sections"][0].update(offset=True), "bad 'offset'"),
        (lambda r: r["sections"][0].update(name="a\nb"), "control characters"),
        (lambda r: r.update(generation=2), "generation 2"),
        (lambda r: r["header"]["sessions"][0].update(id="s1"), "appears twice"),
        (lambda r: r["header"]["sessions"][2]["sections"].append("gone"), "absent"),
        (lambda r: r["header"].pop("pipeline"), "missing 'pipeline'"),
        (lambda r: b"{not json", "not valid JSON"),
        (lambda r: b'{"generation":1,"generation":1}', "repeats a key"),
        (lambda r: b'{"generation":NaN}', "NaN"),
        (lambda r: b"[" * 100_000, "not valid JSON"),
        (lambda r: b"\xff\xfe", "not valid JSON"),
        (lambda r: b"[]", "JSON object"),
    ],
)
def test_malformed_index_with_valid_checksum(
    tmp_path: Path, mutate: Callable[[dict[str, Any]], Any], words: str
) -> None:
    path = tmp_path / "a.skv"
    write_sample(path, tables=False)
    rewrite_first_record(path, mutate)
    expect(MalformedContainerError, lambda: open_container(path), "invalid index", words)


def rewrite_table(path: Path, mutate: Callable[[bytes, bytes], bytes]) -> None:
    """Give index record 1 of a one-segment 1.4 file `mutate(json part, table)`, re-signed."""
    data = path.read_bytes()
    with open_container(path) as container:
        slot = container.slot
    raw = data[slot.index_offset :]
    size = int.from_bytes(raw[:4], "little")
    raw = mutate(raw[4 : 4 + size], raw[4 + size :])
    forged = Slot(0, 1, slot.index_offset, len(raw), crc32c(raw))
    head = data[:16] + encode_slot(data[:16], forged) + data[48:80]
    path.write_bytes(head + data[80 : slot.index_offset] + raw)


def signed(json_part: bytes, table: bytes) -> bytes:
    return len(json_part).to_bytes(4, "little") + json_part + table


def row(shared: int, suffix: bytes, length: int, crc: int = 0) -> bytes:
    return (
        encode_varint(shared)
        + encode_varint(len(suffix))
        + suffix
        + encode_varint(length)
        + crc.to_bytes(4, "little")
    )


def rows(*items: bytes) -> bytes:
    return encode_varint(len(items)) + b"".join(items)


def test_the_binary_table_is_what_docs_format_md_specifies(tmp_path: Path) -> None:
    path = tmp_path / "a.skv"
    header = {"pipeline": [], "model": None, "sessions": []}
    write_container(path, header, [("s0/tokens", b"abc"), ("s0/trie", b"")])
    data = path.read_bytes()
    assert data[8:16] == bytes([1, 0, 9, 0, 3, 0, 0, 0])  # 1.9, byte 12 = 3
    # (record 1 is encoded as in 1.4: 1.6 changed only the records appends write)
    record = data[80 + 3 :]
    json_part = b'{"generation":1,"header":{"pipeline":[],"model":null,"sessions":[]}}'
    table = rows(row(0, b"s0/tokens", 3, crc32c(b"abc")), row(4, b"rie", 0, crc32c(b"")))
    assert record == signed(json_part, table)


@pytest.mark.parametrize(
    ("mutate", "words"),
    [
        (lambda j, t: b"\x05\x00", "shorter than its JSON length"),
        (lambda j, t: (len(j) + len(t) + 1).to_bytes(4, "little") + j + t, "runs past its end"),
        (lambda j, t: signed(j, b""), "ends inside its row count"),
        (lambda j, t: signed(j, t + b"\x00"), "follow the section table"),
        (lambda j, t: signed(j, encode_varint(10**6) + t[1:]), "claims 1000000 rows"),
        (lambda j, t: signed(j, b"\xff" * 9 + b"\x01" + t), "longer than 9 bytes"),
        (lambda j, t: signed(j, t[:-3]), "ends inside row 5's CRC32C"),
        (lambda j, t: signed(j, rows(row(3, b"x", 4))), "shares 3 name bytes"),
        (lambda j, t: signed(j, rows(row(0, b"\xff\xfe", 4))), "not UTF-8"),
        (lambda j, t: signed(j, rows(row(0, b"a\nb", 4))), "control characters"),
        (
            lambda j, t: signed(j, rows(row(0, b"a", 4), row(1, b"", SAMPLE_BYTES - 4))),
            "appears twice",
        ),
        (lambda j, t: signed(j, rows(row(0, b"a", 10**12))), "past the end of its segment"),
        (lambda j, t: signed(j, rows(row(0, b"s0/tokens", 4))), "belong to no section"),
        (
            lambda j, t: signed(j[:-1] + b',"sections":[]}', t),
            "also lists 'sections'",
        ),
        (lambda j, t: signed(b"[]", t), "JSON object"),
    ],
)
def test_malformed_binary_table_with_valid_checksum(
    tmp_path: Path, mutate: Callable[[bytes, bytes], bytes], words: str
) -> None:
    path = tmp_path / "a.skv"
    write_sample(path)
    rewrite_table(path, mutate)
    expect(MalformedContainerError, lambda: open_container(path), "invalid index", words)


def test_an_old_file_takes_appends_in_its_own_format(tmp_path: Path) -> None:
    """Appending to a 1.1 or 1.4 file keeps its encoding, so older seqkv still reads it."""
    for layout, minor in LAYOUTS:
        path = tmp_path / f"{layout}.skv"
        write_container(path, *sample(), layout=layout)
        append_sessions(path, [session("s9", ["s9/x"])], [("s9/x", b"ninth")])
        data = path.read_bytes()
        with open_container(path) as container:
            assert container.version == (1, minor) and container.generation == 2
            assert container.read_section("s9/x") == b"ninth"
            assert container.read_section("s1/鍵🔑") == BIG
            newest = data[container.slot.index_offset :]
        if layout == LAYOUT_JSON:
            assert newest.startswith(b'{"generation":2,')
        elif layout == LAYOUT_TABLES:  # a 1.4 record starts with its JSON part's u32 length
            assert newest[4:].startswith(b'{"generation":2,')
        else:  # 1.6: a varint length, then only the sessions the append adds, as JSON
            size, start = decode_varint(newest, 0, 9)
            assert newest[start : start + size].startswith(b'{"sessions":[{"id":"s9",')
            assert b"generation" not in newest and b"previous" not in newest


def test_damaged_spare_slot_opens_but_fails_verify(tmp_path: Path) -> None:
    path = tmp_path / "a.skv"
    header, _ = write_sample(path)
    data = bytearray(path.read_bytes())
    data[SLOT_OFFSETS[1] + 3] ^= 0x10
    path.write_bytes(bytes(data))
    with open_container(path) as container:
        assert container.damaged_slots == (1,)
        assert container.header == header
        expect(CorruptContainerError, container.verify, "slot 1 is damaged")
    data[SLOT_OFFSETS[0] + 3] ^= 0x10
    path.write_bytes(bytes(data))
    expect(CorruptContainerError, lambda: open_container(path), "both superblock commit slots")


# --- errors while writing; atomicity ------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (lambda h: h["meta"].update(t=(1, 2)), "tuple"),
        (lambda h: h["meta"].update(x=float("nan")), "NaN"),
        (lambda h: h["meta"].update({3: "x"}), "non-string key"),
        (lambda h: h["meta"].update(s="\ud800"), "not valid Unicode"),
        (lambda h: h.pop("pipeline"), "missing 'pipeline'"),
        (lambda h: h["pipeline"].append({"level": 3}), "string 'id'"),
        (lambda h: h.update(model={"name": "x"}), "'fingerprint'"),
        (lambda h: h.update(extra=1), "unknown key 'extra'"),
        (lambda h: h.update(meta=[]), "'meta'"),
        (lambda h: h["sessions"][1].update(id="s0"), "appears twice"),
        (lambda h: h["sessions"][0].update(positions=-1), "'positions'"),
        (lambda h: h["sessions"][0].update(positions=True), "'positions'"),
        (lambda h: h["sessions"][0].pop("dtype"), "'dtype'"),
        (lambda h: h["sessions"][0].update(shapes="3x4"), "'shapes'"),
        (lambda h: h["sessions"][0]["sections"].append("s9/x"), "'s9/x', which is absent"),
        (lambda h: h["sessions"][0]["sections"].append("s0/tokens"), "twice"),
    ],
)
def test_bad_header_is_refused_and_nothing_is_left(
    tmp_path: Path, change: Callable[[dict[str, Any]], Any], words: str
) -> None:
    header, sections = sample()
    change(header)
    path = tmp_path / "a.skv"
    expect(InvalidContainerInputError, lambda: write_container(path, header, sections), words)
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize(
    ("sections", "words"),
    [
        ([("a", b"1"), ("a", b"2")], "'a' is used twice"),
        ([("", b"1")], "non-empty"),
        ([("a\tb", b"1")], "control characters"),
        ([("x" * 1025, b"1")], "over 1024 bytes"),
        ([("a", "text")], "contiguous bytes, not str"),
        ([("a", np.arange(10)[::2])], "contiguous bytes"),
    ],
)
def test_bad_sections_are_refused_and_nothing_is_left(
    tmp_path: Path, sections: list[tuple[str, Any]], words: str
) -> None:
    header = {"pipeline": [], "model": None, "sessions": []}
    path = tmp_path / "a.skv"
    expect(InvalidContainerInputError, lambda: write_container(path, header, sections), words)
    assert leftovers(tmp_path) == []


def test_missing_directory_or_file_as_directory(tmp_path: Path) -> None:
    header, sections = sample()
    expect(
        ContainerWriteError,
        lambda: write_container(tmp_path / "no" / "a.skv", header, sections),
        "does not exist",
    )
    (tmp_path / "file").write_bytes(b"")
    expect(
        ContainerWriteError,
        lambda: write_container(tmp_path / "file" / "a.skv", header, sections),
        "not a directory",
    )
    (tmp_path / "dir.skv").mkdir()
    expect(ContainerWriteError, lambda: write_container(tmp_path / "dir.skv", header, sections))
    assert leftovers(tmp_path) == ["dir.skv", "file"]
    assert leftovers(tmp_path / "dir.skv") == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_unwritable_directory(tmp_path: Path) -> None:
    locked = tmp_path / "ro"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        header, sections = sample()
        expect(
            ContainerWriteError,
            lambda: write_container(locked / "a.skv", header, sections),
            "permission denied",
        )
        assert leftovers(locked) == []
    finally:
        locked.chmod(0o700)


def test_failure_mid_write_leaves_nothing(tmp_path: Path) -> None:
    header, sections = sample()

    def broken() -> Iterator[tuple[str, bytes]]:
        yield from sections[:3]
        raise RuntimeError("encoder crashed")

    with pytest.raises(RuntimeError, match="encoder crashed"):
        write_container(tmp_path / "a.skv", header, broken())
    assert leftovers(tmp_path) == []


def test_failed_rewrite_keeps_the_old_file(tmp_path: Path) -> None:
    path = tmp_path / "a.skv"
    write_sample(path)
    before = path.read_bytes()
    header, sections = sample()
    header["sessions"][0]["sections"].append("missing")
    with pytest.raises(InvalidContainerInputError):
        write_container(path, header, sections)
    assert path.read_bytes() == before
    assert leftovers(tmp_path) == ["a.skv"]


def test_writer_left_without_finish_writes_nothing(tmp_path: Path) -> None:
    def forget() -> None:
        with ContainerWriter(tmp_path / "a.skv") as writer:
            writer.add_section("a", b"1")

    expect(ContainerWriteError, forget, "finish(header) was never called")
    assert leftovers(tmp_path) == []


# --- appends -----------------------------------------------------------------------------


def test_append_keeps_old_bytes_and_merges_sessions(tmp_path: Path) -> None:
    path = tmp_path / "a.skv"
    header, sections = write_sample(path)
    old = path.read_bytes()
    result = append_sessions(
        path, [session("s3", ["s3/tokens", "shared/trie"])], [("s3/tokens", b"new!")]
    )
    assert result.generation == 2
    assert result.section_bytes == 4
    new = path.read_bytes()
    assert new[80 : len(old)] == old[80:]  # nothing committed before was rewritten
    assert new[SLOT_OFFSETS[0] : SLOT_OFFSETS[1]] == old[SLOT_OFFSETS[0] : SLOT_OFFSETS[1]]
    append_sessions(path, [session("s4", ["s4/a"]), session("s5", [])], [("s4/a", b"")])
    with open_container(path) as container:
        assert container.generation == 3
        assert [s["id"] for s in container.header["sessions"]] == [
            "s0", "s1", "s2", "s3", "s4", "s5",
        ]  # fmt: skip
        assert container.header["pipeline"] == header["pipeline"]
        assert container.read_section("s3/tokens") == b"new!"
        for name, data in sections:
            assert container.read_section(name) == data
        container.verify()


def test_append_index_cost_does_not_grow_with_the_file(tmp_path: Path) -> None:
    path = tmp_path / "a.skv"
    write_container(path, {"pipeline": [], "model": None, "sessions": []}, [])
    sizes = []
    for i in range(30):
        result = append_sessions(
            path, [session(f"t{i:03d}", [f"t{i:03d}/x"])], [(f"t{i:03d}/x", b"x")]
        )
        sizes.append(result.index_bytes)
    assert (
        max(sizes) - min(sizes) <= 8
    )  # one record per append (offsets gain digits), not the table
    with open_container(path) as container:
        assert len(container.header["sessions"]) == 30
        container.verify()


def test_refused_append_leaves_the_file_byte_identical(tmp_path: Path) -> None:
    path = tmp_path / "a.skv"
    write_sample(path)
    before = path.read_bytes()
    expect(
        InvalidContainerInputError,
        lambda: append_sessions(path, [session("s0", ["s9/a"])], [("s9/a", b"abc")]),
        "'s0' appears twice",
    )
    expect(
        InvalidContainerInputError,
        lambda: append_sessions(path, [], [("s0/tokens", b"again")]),
        "used twice",
    )

    def broken() -> Iterator[tuple[str, bytes]]:
        yield ("s9/a", b"x" * 1000)
        raise RuntimeError("encoder crashed")

    with pytest.raises(RuntimeError):
        append_sessions(path, [session("s9", ["s9/a"])], broken())
    assert path.read_bytes() == before
    expect(ContainerWriteError, lambda: append_sessions(tmp_path / "no.skv", [], []), "exist")


def test_every_crash_point_of_an_append_leaves_a_readable_file(tmp_path: Path) -> None:
    """Replay the file as it is on disk at each moment of an append (before and after)."""
    path = tmp_path / "a.skv"
    header, _ = write_sample(path)
    old = path.read_bytes()
    append_sessions(path, [session("s3", ["s3/t"])], [("s3/t", b"0123456789" * 50)])
    new = path.read_bytes()
    crash = tmp_path / "crash.skv"
    for cut in sorted({len(old), len(old) + 1, len(old) + 250, len(new) - 1, len(new)}):
        crash.write_bytes(old[:80] + new[80:cut])  # killed before the slot write
        with open_container(crash) as container:
            assert container.generation == 1
            assert container.header == header
            assert container.uncommitted_bytes == cut - len(old)
            container.verify()
    torn = bytearray(new)
    torn[SLOT_OFFSETS[1] + 16 : SLOT_OFFSETS[1] + 32] = old[
        SLOT_OFFSETS[1] + 16 : SLOT_OFFSETS[1] + 32
    ]
    crash.write_bytes(bytes(torn))  # power loss in the middle of the slot write
    with open_container(crash) as container:
        assert container.generation == 1
        assert container.read_section("s1/鍵🔑") == BIG
        expect(CorruptContainerError, container.verify, "slot 1 is damaged")
    crash.write_bytes(old[:80] + new[80:-7])
    append_sessions(crash, [session("s4", ["s4/t"])], [("s4/t", b"after crash")])
    with open_container(crash) as container:
        assert container.generation == 2
        assert container.uncommitted_bytes == 0
        assert [s["id"] for s in container.header["sessions"]][-1] == "s4"
        container.verify()


def test_sigkill_during_append_keeps_old_contents(tmp_path: Path) -> None:
    path = tmp_path / "a.skv"
    header, _ = write_sample(path)
    child = textwrap.dedent(
        f"""
        import sys, time
        from seqkv_cli.container import append_sessions
        def sections():
            yield ("s3/a", b"a" * 3_000_000)
            print("ready", flush=True)
            time.sleep(60)
            yield ("s3/b", b"b")
        append_sessions({str(path)!r}, [{{"id": "s3", "positions": 1, "dtype": "x",
                         "shapes": [], "sections": ["s3/a", "s3/b"]}}], sections())
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    with open_container(path) as container:
        assert container.generation == 1
        assert container.header == header
        assert container.uncommitted_bytes == 3_000_000  # the unfinished segment, ignored
        container.verify()
    append_sessions(path, [session("s3", ["s3/a"])], [("s3/a", b"retry")])
    with open_container(path) as container:
        assert container.read_section("s3/a") == b"retry"
        assert container.uncommitted_bytes == 0
        container.verify()
