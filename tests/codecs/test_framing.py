"""The one stream framing: magic and version, length-prefixed parts, CRCs, one error each."""

from __future__ import annotations

import pytest

from seqkv_codecs.errors import CorruptStreamError
from seqkv_codecs.framing import StreamReader, part, with_crc32


def test_parts_round_trip_behind_magic_and_version():
    data = b"DEMO\x02" + part(b"abc") + part(b"") + b"\x2a"
    reader = StreamReader(data, "demo")
    assert reader.opening(b"DEMO", (1, 2)) == 2
    assert [bytes(p) for p in reader.parts(2)] == [b"abc", b""]
    assert reader.left == 1 and reader.unpack("<B") == (42,)
    reader.finish()


@pytest.mark.parametrize(
    ("data", "words"),
    [
        (b"DEMX\x01", r"not a demo stream: magic b'DEMX', expected b'DEMO'"),
        (
            b"DEMO\x03",
            r"demo stream version 3 is not supported \(this seqkv reads version 1 and 2\)",
        ),
        (b"DEM", "demo stream is truncated: needs 4 bytes at offset 0, only 3 left"),
        (b"DEMO\x01" + part(b"abc")[:-1], "demo stream is truncated: needs 3 bytes at offset 9"),
        (b"DEMO\x01" + part(b"abc") + b"!", "demo stream has 1 unexpected trailing bytes"),
    ],
)
def test_each_refusal_is_one_clear_error(data, words):
    reader = StreamReader(data, "demo")
    with pytest.raises(CorruptStreamError, match=words):
        reader.opening(b"DEMO", (1, 2))
        reader.part()
        reader.finish()


def test_crc32_in_the_header_and_trailing():
    head = with_crc32(b"DEMO\x01\x05")
    reader = StreamReader(head + b"payload", "demo")
    reader.opening(b"DEMO", (1,))
    reader.unpack("<B")
    reader.crc32()
    assert bytes(reader.rest()) == b"payload"
    damaged = StreamReader(b"DEMO\x01\x06" + head[-4:], "demo")
    damaged.take(6)
    with pytest.raises(CorruptStreamError, match="demo stream header failed its CRC"):
        damaged.crc32()
    whole = with_crc32(b"DEMO\x01" + part(b"x"))
    reader = StreamReader(whole, "demo", trailing_crc32=True)
    reader.opening(b"DEMO", (1,))
    assert bytes(reader.part()) == b"x"
    reader.finish()  # the CRC is not part of what is read
    for bad in (whole[:-1], whole[:3], b"X" + whole[1:]):
        with pytest.raises(CorruptStreamError, match="truncated or failed its CRC"):
            StreamReader(bad, "demo", trailing_crc32=True)


def test_varints_are_read_with_the_stream_named():
    reader = StreamReader(b"\xac\x02\x80", "demo")
    assert reader.varint() == 300
    with pytest.raises(CorruptStreamError, match="demo stream: a varint runs past the end"):
        reader.varint()
