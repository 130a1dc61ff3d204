"""Compact files — single sessions (format 1.2) and compact archives (1.8): layout, limits,
and every way a file can be bad."""

from __future__ import annotations

import struct
import zlib

import pytest

from seqkv_cli.container import (
    ContainerError,
    ContainerWriteError,
    CorruptContainerError,
    InvalidContainerInputError,
    MalformedContainerError,
    TruncatedContainerError,
    UnsupportedVersionError,
    open_container,
)
from seqkv_cli.container.compact import (
    ARCHIVE_SECTION,
    FIXED_HEADER,
    TOKENS_SECTION,
    CompactProfile,
    CompactSession,
    encode_compact,
    encode_compact_archive,
    write_compact,
    write_compact_archive,
)
from seqkv_cli.container.compact_reader import CompactReader
from seqkv_cli.container.errors import SectionCorruptError
from seqkv_cli.container.format import FORMAT_MINOR, MAX_INDEX_BYTES, crc32c, encode_varint
from seqkv_cli.container.reader import ContainerReader

PAYLOAD = bytes(range(200)) * 2


def session(**changes) -> CompactSession:
    fields = {
        "codec": "seq",
        "residual": "lossless",
        "numerics": "portable-fx53-v1",
        "fingerprint": "c821f1a1b4d9b677",
        "session_id": "prose",
        "positions": 648,
        "dtype": "bf16",
        "numeric_path": "portable-fx53-v1",
        "num_layers": 30,
        "num_kv_heads": 3,
        "head_dim": 64,
        "log2_ppl_milli": 3788,
        "token_check": 0xBEEF,
    }
    return CompactSession(**{**fields, **changes})


def write(tmp_path, data: bytes, name="s.skv"):
    path = tmp_path / name
    path.write_bytes(data)
    return path


def test_round_trip_fields_header_and_payload(tmp_path):
    path = tmp_path / "one.skv"
    size = write_compact(path, session(), PAYLOAD)
    assert size == path.stat().st_size == len(PAYLOAD) + 48  # 43 bytes + the 5-byte id
    with open_container(path) as reader:
        assert isinstance(reader, CompactReader)
        assert reader.version == (1, 2)
        assert reader.compact == session()
        assert reader.header["pipeline"] == [
            {
                "id": "seq",
                "precision_bits": 24,
                "chunk_size": 1024,
                "residual": "lossless",
                "numerics": "portable-fx53-v1",
            }
        ]
        assert reader.header["model"] == {"fingerprint": "c821f1a1b4d9b677"}
        assert "trie" in reader.header and reader.header["sessions"] == []
        [entry] = reader.sections
        assert (entry.name, entry.length) == (TOKENS_SECTION, len(PAYLOAD))
        assert entry.crc32c == crc32c(PAYLOAD)
        assert reader.read_section(TOKENS_SECTION) == PAYLOAD
        reader.verify()
        assert reader.index_bytes == size - len(PAYLOAD)
    assert [p.name for p in tmp_path.iterdir()] == ["one.skv"]  # no temporary left


@pytest.mark.parametrize(
    "changes",
    [
        {"codec": "seq-fast", "residual": "none", "numerics": "canonical-fp32-rb8-kb256-v1"},
        {"dtype": "fp32", "numeric_path": "user-cache", "session_id": "chat <b>&amp;</b> ü"},
        {"positions": 1, "log2_ppl_milli": 0xFFFF, "num_layers": 65535, "head_dim": 1},
    ],
)
def test_every_enumerated_value_round_trips(tmp_path, changes):
    path = tmp_path / "one.skv"
    write_compact(path, session(**changes), PAYLOAD)
    with open_container(path) as reader:
        assert reader.compact == session(**changes)


@pytest.mark.parametrize(
    "changes, why",
    [
        ({"codec": "turbo3"}, "codec"),
        ({"residual": "tolerance"}, "residual mode"),
        ({"numerics": "portable-fx54-v9"}, "numeric path"),
        ({"dtype": "int8"}, "dtype"),
        ({"numeric_path": "cuda-bf16"}, "capture numeric path"),
        ({"session_id": ""}, "empty"),
        ({"session_id": "a\nb"}, "control characters"),
        ({"session_id": "x" * 1025}, "over 1024 bytes"),
        ({"fingerprint": "c821"}, "not a compact session"),
    ],
)
def test_the_writer_refuses_what_the_layout_cannot_hold(tmp_path, changes, why):
    with pytest.raises(InvalidContainerInputError, match=why):
        encode_compact(session(**changes), PAYLOAD)
    with pytest.raises(InvalidContainerInputError):
        write_compact(tmp_path / "x.skv", session(**changes), PAYLOAD)
    assert list(tmp_path.iterdir()) == []


def test_a_write_into_a_missing_directory_is_one_line_and_leaves_nothing(tmp_path):
    with pytest.raises(ContainerWriteError, match="cannot write"):
        write_compact(tmp_path / "no" / "x.skv", session(), PAYLOAD)
    assert list(tmp_path.iterdir()) == []


def test_every_truncation_is_refused(tmp_path):
    data = encode_compact(session(), PAYLOAD)
    for cut in range(len(data)):
        path = write(tmp_path, data[:cut])
        with pytest.raises(ContainerError) as info, open_container(path) as reader:
            reader.verify()
        assert "\n" not in str(info.value)
        if cut >= 13:  # past the layout byte: it is known to be a compact file
            assert isinstance(info.value, TruncatedContainerError | CorruptContainerError)


def test_every_bit_flip_is_caught_before_a_token_is_decoded(tmp_path):
    data = encode_compact(session(), PAYLOAD[:40])
    for i in range(len(data)):
        for bit in range(8):
            flipped = bytearray(data)
            flipped[i] ^= 1 << bit
            path = write(tmp_path, bytes(flipped))
            with pytest.raises(ContainerError), open_container(path) as reader:
                reader.verify()


def _forge(fields: bytes, payload: bytes = b"xyz", head: bytes | None = None) -> bytes:
    """A compact file whose header CRC is valid for whatever `fields` say."""
    head = head or bytes.fromhex("89534b560d0a1a0a0100020001 00 c821f1a1b4d9b677 00")
    body = head + fields
    crc = crc32c(payload).to_bytes(4, "little")
    return body + crc32c(body).to_bytes(4, "little") + payload + crc


GOOD = bytes([30, 3, 64, 3]) + struct.pack("<HH", 1, 2) + b"\x01a" + b"\x03"


@pytest.mark.parametrize(
    "fields, message",
    [
        (bytes([0, 3, 64, 3]) + GOOD[4:], "impossible shape"),
        (bytes([30, 3, 0, 3]) + GOOD[4:], "impossible shape"),
        (bytes([30, 3, 0x80, 0x80, 0x08, 3]) + GOOD[4:], "impossible shape"),
        (bytes([30, 3, 64, 0]) + GOOD[4:], "impossible length"),
        (bytes([30, 3, 64, 0xFF, 0xFF, 0xFF, 0xFF, 0x0F]) + GOOD[4:], "impossible length"),
        (GOOD[:8] + b"\x00" + b"\x03", "session id is empty"),
        (GOOD[:8] + b"\x03a\x1bb" + b"\x03", "control characters"),
        (GOOD[:8] + b"\x02\xff\xfe" + b"\x03", "not UTF-8"),
        (GOOD[:8] + b"\x01a" + b"\x04", "truncated"),
        (GOOD[:8] + b"\x01a" + b"\x02", "bytes after its end"),
        (GOOD[:8] + b"\x01a" + b"\x80" * 11, "too long"),
    ],
)
def test_checksum_valid_files_with_hostile_fields_are_refused(tmp_path, fields, message):
    path = write(tmp_path, _forge(fields))
    with pytest.raises(ContainerError, match=message) as info:
        open_container(path)
    assert str(info.value).startswith(str(path))


def test_the_forged_baseline_itself_opens(tmp_path):
    with open_container(write(tmp_path, _forge(GOOD))) as reader:
        assert reader.compact.session_id == "a" and reader.read_section(TOKENS_SECTION) == b"xyz"


@pytest.mark.parametrize(
    "pipeline, kinds, message",
    [
        (0x10, 0x00, "unknown pipeline bits"),
        (0x00, 0x03, "unknown dtype"),
        (0, 0x60, "path"),
        (0x0C, 0x00, r"portable-fx53-v3 in a format 1\.2 file \(its codes came in 1\.5\)"),
        (0x08, 0x00, r"portable-fx53-v2 in a format 1\.2 file"),
        (0x00, 0x50, r"portable-fx53-v3 in a format 1\.2 file"),
    ],
)
def test_unknown_codes_are_refused(tmp_path, pipeline, kinds, message):
    head = bytearray(bytes.fromhex("89534b560d0a1a0a0100020001 00 c821f1a1b4d9b677 00"))
    head[13], head[22] = pipeline, kinds
    with pytest.raises(MalformedContainerError, match=message):
        open_container(write(tmp_path, _forge(GOOD, head=bytes(head))))


def test_a_newer_minor_and_an_unknown_layout_ask_for_an_upgrade(tmp_path):
    data = bytearray(encode_compact(session(), PAYLOAD))
    data[10] = FORMAT_MINOR + 1
    with pytest.raises(UnsupportedVersionError, match=rf"format 1\.{FORMAT_MINOR + 1}\); upgrade"):
        open_container(write(tmp_path, bytes(data)))
    data[12] = 7  # a layout this seqkv does not know, in a file of a newer minor
    with pytest.raises(UnsupportedVersionError, match="upgrade seqkv"):
        open_container(write(tmp_path, bytes(data)))


def test_the_full_layout_reader_names_a_compact_file(tmp_path):
    path = write(tmp_path, encode_compact(session(), PAYLOAD))
    with pytest.raises(UnsupportedVersionError, match="its layout is compact"):
        ContainerReader(path)


def test_a_section_the_file_does_not_hold(tmp_path):
    path = write(tmp_path, encode_compact(session(), PAYLOAD))
    with open_container(path) as reader, pytest.raises(ContainerError, match="only t1/tokens"):
        reader.read_section("t1/index")


def test_the_file_is_exactly_what_docs_format_md_specifies():
    data = encode_compact(session(session_id="a", positions=300), b"PAYLOAD")
    fixed = bytes.fromhex("89534b560d0a1a0a010002000100c821f1a1b4d9b67700")
    fields = bytes([30, 3, 64]) + bytes([0xAC, 0x02]) + struct.pack("<HH", 3788, 0xBEEF)
    fields += b"\x01a" + b"\x07"
    body = fixed + fields
    assert data == body + crc32c(body).to_bytes(4, "little") + b"PAYLOAD" + crc32c(
        b"PAYLOAD"
    ).to_bytes(4, "little")
    assert len(data) - len(b"PAYLOAD") == 43  # the fixed cost of a one-character id


def test_v2_numerics_are_format_1_3_and_v1_files_stay_1_2(tmp_path):
    """A 1.2 reader must ask for an upgrade instead of misreading the new numerics codes."""
    v2 = session(numerics="portable-fx53-v2", numeric_path="portable-fx53-v2")
    data = encode_compact(v2, PAYLOAD)
    assert data[10] == 3 and data[13] >> 2 & 3 == 2 and data[22] >> 4 == 4
    with open_container(write(tmp_path, data)) as reader:
        assert reader.compact == v2 and reader.version == (1, 3)
    assert encode_compact(session(), PAYLOAD)[10] == 2


def test_v3_numerics_are_format_1_5(tmp_path):
    """A 1.4 reader (seqkv 0.4) asks for an upgrade instead of misreading the v3 codes; a v2
    session stays 1.3, so 0.3-0.4 keep reading what they can."""
    v3 = session(numerics="portable-fx53-v3", numeric_path="portable-fx53-v3")
    data = encode_compact(v3, PAYLOAD)
    assert data[10] == 5 and data[13] >> 2 & 3 == 3 and data[22] >> 4 == 5
    with open_container(write(tmp_path, data)) as reader:
        assert reader.compact == v3 and reader.version == (1, 5)
    # a v3 stream over a capture made on v2 (compress --numerics portable of an old capture)
    mixed = session(numerics="portable-fx53-v3", numeric_path="portable-fx53-v2")
    assert encode_compact(mixed, PAYLOAD)[10] == 5
    v2 = session(numerics="portable-fx53-v2", numeric_path="portable-fx53-v2")
    assert encode_compact(v2, PAYLOAD)[10] == 3


# --- compact archives (format 1.8): the container keeps a deflated table and the tokens ---

TABLE = b"a version-2 segment table, which the container does not read " * 3


def profile(**changes) -> CompactProfile:
    fields = {k: v for k, v in vars(session()).items() if k in CompactProfile.__dataclass_fields__}
    return CompactProfile(**{**fields, **changes})


def archive_bytes(packed: bytes, payload: bytes, minor: int = 8, layout: int = 4) -> bytes:
    """A compact archive built by hand around an already deflated table (checksums valid)."""
    head = bytearray(FIXED_HEADER.pack(b"\x89SKV\r\n\x1a\n", 1, minor, layout, 0, bytes(8), 0))
    for value in (30, 3, 64, len(packed), len(payload)):
        head += encode_varint(value)
    head += crc32c(bytes(head)).to_bytes(4, "little")
    body = packed + payload
    return bytes(head) + body + crc32c(body).to_bytes(4, "little")


def deflated(data: bytes) -> bytes:
    deflater = zlib.compressobj(9, zlib.DEFLATED, -15)
    return deflater.compress(data) + deflater.flush()


def test_a_compact_archive_reads_as_its_table_then_its_tokens(tmp_path):
    path = tmp_path / "many.skv"
    size = write_compact_archive(path, profile(), TABLE, PAYLOAD)
    assert size == path.stat().st_size == len(encode_compact_archive(profile(), TABLE, PAYLOAD))
    with open_container(path) as reader:
        assert isinstance(reader, CompactReader) and reader.archive
        assert reader.version == (1, 8) and reader.compact == profile()
        [entry] = reader.sections
        assert entry.name == ARCHIVE_SECTION
        assert reader.read_section(ARCHIVE_SECTION) == TABLE + PAYLOAD
        assert entry.length == size - reader.header_bytes - 4 < len(TABLE) + len(PAYLOAD)
        reader.verify()
        with pytest.raises(ContainerError, match="only t1/index"):
            reader.read_section(TOKENS_SECTION)
    # a profile whose codes came in 1.5 still makes a 1.8 file (the layout came then)
    write_compact_archive(path, profile(numerics="portable-fx53-v3"), TABLE, PAYLOAD)
    with open_container(path) as reader:
        assert reader.version == (1, 8) and reader.compact.numerics == "portable-fx53-v3"
    with pytest.raises(UnsupportedVersionError, match="its layout is compact"):
        ContainerReader(path)


@pytest.mark.parametrize(
    "packed, payload, error, words",
    [
        (b"\xff" * 9, PAYLOAD, MalformedContainerError, "does not inflate"),
        (deflated(TABLE) + b"!", PAYLOAD, MalformedContainerError, "does not end where"),
        (deflated(TABLE)[:-2], PAYLOAD, MalformedContainerError, "does not end where"),
        (deflated(bytes(MAX_INDEX_BYTES + 1)), b"", MalformedContainerError, "inflates past"),
    ],
)
def test_a_table_with_a_valid_checksum_but_hostile_bytes_is_refused(
    tmp_path, packed, payload, error, words
):
    path = write(tmp_path, archive_bytes(packed, payload))
    with pytest.raises(error, match=words) as info, open_container(path) as reader:
        reader.read_section(ARCHIVE_SECTION)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "data, error, words",
    [
        (archive_bytes(deflated(TABLE), PAYLOAD, minor=7), MalformedContainerError, "format 1.7"),
        (archive_bytes(b"", PAYLOAD), MalformedContainerError, "table is empty"),
        (archive_bytes(deflated(TABLE), PAYLOAD) + b"x", MalformedContainerError, "after its end"),
        (archive_bytes(deflated(TABLE), PAYLOAD, minor=10), UnsupportedVersionError, "upgrade"),
    ],
)
def test_a_compact_archive_header_that_lies_is_refused(tmp_path, data, error, words):
    with pytest.raises(error, match=words), open_container(write(tmp_path, data)):
        pass


def test_every_truncation_and_bit_flip_of_a_compact_archive_is_caught(tmp_path):
    data = encode_compact_archive(profile(), TABLE, PAYLOAD[:40])
    for cut in range(len(data)):
        path = write(tmp_path, data[:cut])
        with pytest.raises(ContainerError) as info, open_container(path) as reader:
            reader.verify()
        assert "\n" not in str(info.value)
    for at in range(len(data)):
        flipped = bytearray(data)
        flipped[at] ^= 0x10
        path = write(tmp_path, bytes(flipped))
        with pytest.raises(ContainerError), open_container(path) as reader:
            reader.verify()  # the header's CRC32C, or the one over table and tokens
    path = write(tmp_path, data)
    with open_container(path) as reader:
        reader.verify()
    body = bytearray(data)
    body[-10] ^= 1
    corrupt = write(tmp_path, bytes(body))
    reader = open_container(corrupt)  # the header is intact: the open succeeds
    try:
        with pytest.raises(SectionCorruptError, match="table or token payload is corrupt"):
            reader.read_section(ARCHIVE_SECTION)
    finally:
        reader.close()
