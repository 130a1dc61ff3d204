"""Trie tables read their varints with the shared codec and keep their own refusals."""

from __future__ import annotations

import json
import zlib

import pytest

from seqkv_cli.errors import SeqkvError
from seqkv_cli.trie.tables import (
    FRESH,
    MAGIC,
    VERSION,
    Node,
    SegmentTables,
    SessionRecord,
    TableContext,
    decode_tables,
    encode_tables,
)
from seqkv_codecs.varint import encode_varint


def _tables() -> SegmentTables:
    nodes = [Node(-1, 0, 300, 40, 7), Node(0, 200, 5, 3, 9)]
    sessions = [SessionRecord("a", 0, 300), SessionRecord("b", 1, 4, log2_ppl_milli=1234)]
    return SegmentTables(nodes, sessions, [{"shapes": {}}])


def test_bytes_are_unchanged():
    data = encode_tables(_tables(), 0)
    # head, counts 2/2/0, node 0 (root, 300 = ac 02, payload 40, check 7),
    # node 1 (back 1, attach 200 = c8 01, 5 tokens, payload 3, check 9),
    # session a: zigzag(0 - -1) * 2 + full = 4, ppl 0xffff; session b: zigzag(1) * 2 + 1, end 4
    assert data.startswith(
        MAGIC
        + bytes([VERSION, 0, 2, 2, 0])
        + bytes.fromhex("00 00 ac02 28 0700")
        + bytes.fromhex("01 c801 05 03 0900")
        + bytes.fromhex("04 ffff")
        + bytes.fromhex("05 04 d204")
    )
    back = decode_tables(data, 0, "x")
    assert [(s.id, s.end_node, s.end) for s in back.sessions] == [("a", 0, -1), ("b", 1, 4)]
    assert [n.n_tokens for n in back.nodes] == [300, 5]


def test_truncated_and_overlong_numbers_are_refused():
    head = MAGIC + bytes([VERSION, 0])
    for bad in (head + b"\x80", head + b"\x80" * 10 + b"\x00"):
        with pytest.raises(SeqkvError, match=r"x: trie table is damaged \(a number runs past"):
            decode_tables(bad, 0, "x")
    # ten bytes is still a number (here an impossible count)
    with pytest.raises(SeqkvError, match="impossible counts"):
        decode_tables(head + b"\x80" * 9 + b"\x01\x00\x00", 0, "x")


def test_negative_numbers_are_an_internal_error():
    with pytest.raises(SeqkvError, match="internal: negative varint"):
        encode_tables(SegmentTables([Node(-1, -1, 1, 0, 0)], [], [{}]), 0)


# --- version 2: written against the archive before it (format 1.6) ------------------------


PROFILE = {
    "dtype": "bf16",
    "numeric_path": "portable-fx53-v3",
    "shapes": {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64},
    "capture_meta": {"versions": {"seqkv": "0.6.0"}},
}


def _turn(k: int, created: str, extra: dict | None = None) -> SegmentTables:
    """Turn k of an agent: one node of 100 tokens under the node before, one session."""
    node = Node(-1, 0, 100, 60, 7) if k == 0 else Node(k - 1, 100, 100, 60, 7)
    session = SessionRecord(f"run-7/turn-{k + 1}", k, 100, 4200, 0, extra or {})
    profile = dict(PROFILE, capture_meta=dict(PROFILE["capture_meta"], created=created))
    return SegmentTables([node], [session], [profile])


def _grow(
    turns: list[SegmentTables], start: TableContext = FRESH
) -> tuple[list[bytes], list[SegmentTables]]:
    """Encode turn after turn against the archive so far (from `start`), then read them back
    the same way."""
    written, context = [], start
    for k, tables in enumerate(turns):
        written.append(encode_tables(tables, k, context))
        context = context.after(tables)
    read, context = [], start
    for k, data in enumerate(written):
        read.append(decode_tables(data, k, f"segment {k + 1}", context))
        context = context.after(read[-1])
    return written, read


def test_a_turn_costs_about_twenty_bytes_and_reads_back_whole():
    times = ["2026-12-06T02:27:19Z", "2026-12-06T02:27:25Z", "2026-12-06T02:29:01Z"]
    turns = [_turn(k, t) for k, t in enumerate(times)] + [_turn(3, times[2], {"meta": {"a": 1}})]
    written, read = _grow(turns)
    assert written[0][0] & 0xE0 == 0x20 and not written[0].startswith(MAGIC)
    # 0x20 | flags (inherited, created), +6 s, counts 1/1, node (back 1, attach 100,
    # 100 tokens, payload 60, check 7), session (zigzag(1) * 2 = 4, ppl 4200), id: 11 shared, "2"
    assert written[1] == bytes.fromhex("26 0c 0101 01 64 64 3c 0700 04 6810 0b 01 32")
    assert len(written[2]) == len(written[1]) + 1  # 96 s is two bytes of delta
    assert len(written[0]) > 60  # the first segment stores its profile
    for want, got in zip(turns, read, strict=True):
        # -1: the session runs to its node's end (the loader resolves it)
        assert [(s.id, s.end_node, s.end, s.log2_ppl_milli, s.extra) for s in got.sessions] == [
            (s.id, s.end_node, -1, s.log2_ppl_milli, s.extra) for s in want.sessions
        ]
        assert got.profiles == want.profiles  # the creation time is back in capture_meta
        assert [(n.parent, n.attach, n.n_tokens, n.payload, n.check) for n in got.nodes] == [
            (n.parent, n.attach, n.n_tokens, n.payload, n.check) for n in want.nodes
        ]


def test_profiles_are_stored_again_when_they_change():
    other = _turn(1, "2026-12-06T02:27:25Z")
    other.profiles[0]["dtype"] = "fp32"
    written, read = _grow([_turn(0, "2026-12-06T02:27:19Z"), other])
    assert written[1][0] & 8 and not written[1][0] & 2  # strings stored, nothing inherited
    assert read[1].profiles[0]["dtype"] == "fp32"


def test_times_seqkv_did_not_write_stay_in_the_json():
    for created in ("2026-12-06 02:27:19", "2026-12-06T02:27:19.5Z", 17, None):
        tables = _turn(0, "x")
        tables.profiles[0]["capture_meta"]["created"] = created
        (data,), (back,) = _grow([tables])
        assert not data[0] & 4
        assert back.profiles == tables.profiles


def test_ids_share_bytes_with_the_id_before_across_segments():
    context = TableContext(last_id="agent/ü/turn-9")
    tables = SegmentTables(
        [Node(-1, 0, 3, 1, 0)],
        [SessionRecord("agent/ü/turn-10", 0, 3), SessionRecord("b", 0, 2)],
        [{"shapes": {}}],
    )
    back = decode_tables(encode_tables(tables, 0, context), 0, "x", context)
    assert [s.id for s in back.sessions] == ["agent/ü/turn-10", "b"]


def _damaged(data: bytes, context: TableContext = FRESH) -> str:
    with pytest.raises(SeqkvError) as info:
        decode_tables(data, 0, "x", context)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_every_truncation_of_a_version_2_table_is_refused_in_one_line():
    (first,), _ = _grow([_turn(0, "2026-12-06T02:27:19Z", {"meta": {"k": [1, 2]}})])
    for size in range(len(first)):
        assert "trie table is damaged" in _damaged(first[:size])
    assert "3 is newer; upgrade seqkv" in _damaged(bytes([3]) + first[1:])
    # what follows the table is the segment's token stream
    assert decode_tables(first + b"\x07\x08", 0, "x").tokens == b"\x07\x08"
    assert decode_tables(first, 0, "x").tokens == b""


def _raw(flags: int, *fields: bytes) -> bytes:
    return bytes([0x20 | flags]) + b"".join(fields)


ONE_NODE = bytes.fromhex("0101 00 00 05 00 0000")  # counts 1/1, a root of 5 tokens
ONE_SESSION = bytes.fromhex("04 ffff")  # ends at the root's end, no log2 PP


DEEP = json.loads("[" * 40 + "]" * 40)


def _strings(obj: object) -> bytes:
    packed = zlib.compress(json.dumps(obj).encode())
    return bytes([len(packed)]) + packed


PLAIN = TableContext(profiles=({},))  # a segment before whose profile is inherited
ID = b"\x00\x01a"  # the front-coded id "a" (tables without a JSON block)


@pytest.mark.parametrize(
    ("data", "context", "words"),
    [
        (_raw(2, ONE_NODE, ONE_SESSION, b"\x03\x01a"), TableContext("ab", ({},)), "longer than"),
        (_raw(2, ONE_NODE, ONE_SESSION, b"\x00\x00"), PLAIN, "has no name"),
        (_raw(2, ONE_NODE, ONE_SESSION, b"\x00\x02\xff\xfe"), PLAIN, "not UTF-8"),
        (_raw(0, ONE_NODE, ONE_SESSION, ID), FRESH, "or neither"),
        (_raw(8, ONE_NODE, ONE_SESSION, _strings({"sessions": [["a"]]})), FRESH, "or neither"),
        (
            _raw(10, ONE_NODE, ONE_SESSION, _strings({"profiles": [{}], "sessions": [["a"]]})),
            PLAIN,
            "both inherited and stored",
        ),
        (_raw(2, ONE_NODE, ONE_SESSION, ID), FRESH, "names a missing profile"),
        (_raw(8, ONE_NODE, ONE_SESSION, _strings({"profiles": [{}]})), FRESH, "session count"),
        (
            _raw(
                8, ONE_NODE, ONE_SESSION, _strings({"profiles": [{}], "sessions": [["a"], ["b"]]})
            ),
            FRESH,
            "session count",
        ),
        (
            _raw(8, ONE_NODE, ONE_SESSION, _strings({"profiles": [{}], "sessions": [[""]]})),
            FRESH,
            "no name",
        ),
        (
            _raw(8, ONE_NODE, ONE_SESSION, _strings({"profiles": [{}], "sessions": [[7]]})),
            FRESH,
            "no name",
        ),
        (
            _raw(8, ONE_NODE, ONE_SESSION, _strings({"profiles": [{}], "sessions": [["a", 5]]})),
            FRESH,
            "not an object",
        ),
        (
            _raw(
                8, ONE_NODE, ONE_SESSION, _strings({"profiles": [{}], "sessions": [["a", {}, {}]]})
            ),
            FRESH,
            "not an object",
        ),
        (_raw(8, ONE_NODE, ONE_SESSION, _strings([])), FRESH, "not an object"),
        (
            _raw(8, ONE_NODE, ONE_SESSION, _strings({"profiles": DEEP, "sessions": [["a"]]})),
            FRESH,
            "nesting at most",
        ),
        (
            _raw(
                12,
                b"\x01",
                ONE_NODE,
                ONE_SESSION,
                _strings({"profiles": [{}], "sessions": [["a"]]}),
            ),
            FRESH,
            "creation time is out of range",
        ),
    ],
)
def test_a_version_2_table_with_hostile_fields_is_refused(data, context, words):
    assert words in _damaged(data, context)


def test_a_zlib_bomb_in_version_2_strings_stops_at_the_cap():
    bomb = zlib.compress(b" " * (64 << 20), 9)
    data = _raw(8, ONE_NODE, ONE_SESSION, encode_varint(len(bomb)), bomb)
    assert "inflate past" in _damaged(data)


def test_an_id_cannot_grow_past_64_kib_by_sharing():
    """Each id may repeat all of the one before: a chain of them stops at 64 KiB an id."""
    n = 70
    counts = encode_varint(1) + encode_varint(n) + bytes.fromhex("00 00 05 00 0000")
    sessions = bytes.fromhex("04 ffff") + bytes.fromhex("00 ffff") * (n - 1)
    ids = b"".join(encode_varint(1000 * k) + encode_varint(1000) + b"b" * 1000 for k in range(n))
    assert "longer than the name before it allows" in _damaged(
        _raw(2, counts, sessions, ids), PLAIN
    )


def test_a_segment_of_another_codec_names_it_after_a_wide_tag():
    """Format 1.7: flag bit 5 moves the tag to 0x80 | flags; tables without it keep 1.6's."""
    turns = [_turn(0, "2026-12-06T02:27:19Z"), _turn(1, "2026-12-06T02:27:25Z")]
    turns[1].codec = "seq-fast"
    written, read = _grow(turns)
    assert written[0][0] & 0xE0 == 0x20 and read[0].codec is None
    plain = _grow([turns[0], _turn(1, "2026-12-06T02:27:25Z")])[0][1]
    # 0x80 | 0x20 (codec) | inherited | created, +6 s, then the id, then what 1.6 writes
    assert written[1] == bytes([0xA6]) + b"\x0c\x08seq-fast" + plain[2:]
    assert read[1].codec == "seq-fast" and read[1].sessions[0].id == "run-7/turn-2"
    for size in range(len(written[1])):
        assert "trie table is damaged" in _damaged(written[1][:size], FRESH.after(turns[0]))


@pytest.mark.parametrize(
    ("first", "name", "words"),
    [
        (0xA0, b"", "impossible length"),
        (0xA0, b"s" * 33, "impossible length"),
        (0xA0, b"seq fast", "not a codec name"),
        (0xA0, "séq".encode(), "not a codec name"),
        (0x80, b"", "magic"),  # a wide tag must carry the codec or the replay flag
        (0x10, b"seq", "version 16 is newer; upgrade seqkv"),  # a later table version
    ],
)
def test_a_hostile_codec_id_is_refused_in_one_line(first, name, words):
    data = bytes([first]) + encode_varint(len(name)) + name + ONE_NODE + ONE_SESSION
    assert words in _damaged(data)


def _chain_tables(ends: list[tuple[int, int]]) -> SegmentTables:
    """Two roots of 500 and 300 tokens; sessions ending `(node, end)` in table order."""
    nodes = [Node(-1, 0, 500, 0, 7), Node(-1, 0, 300, 0, 9)]
    sessions = [SessionRecord(f"t-{k}", n, e, 4000 + k) for k, (n, e) in enumerate(ends)]
    return SegmentTables(nodes, sessions, [{"shapes": {}}])


@pytest.mark.parametrize(
    "ends",
    [
        [(0, 100), (0, 200), (0, 300), (0, 400), (0, 500)],  # an agent's turns, merged
        [(0, 400), (0, 100), (1, 50), (1, 300), (0, 20), (0, 500), (0, 7)],  # any order
        [(1, 1), (1, 1), (0, 499)],
    ],
)
def test_relative_ends_read_back_as_written(ends):
    context = TableContext("", ({"shapes": {}},), 0)
    tables = _chain_tables(ends)
    data = encode_tables(tables, 0, context, relative_ends=True)
    back = decode_tables(data, 0, "x", context, relative_ends=True)
    sizes = [500, 300]
    assert [(s.end_node, s.end) for s in back.sessions] == [
        (n, -1 if e == sizes[n] else e) for n, e in ends
    ]
    assert [s.id for s in back.sessions] == [s.id for s in tables.sessions]
    # the same table read with absolute ends gives other ends: the flag matters
    if ends[1] == (0, 200):
        absolute = decode_tables(data, 0, "x", context)
        assert absolute.sessions[2].end == 200  # zigzag(300 - 200), not 300
        # equal steps are one repeated pair of bytes (zigzag(100) = c8 01), not 100, 200, ...
        assert data.count(bytes.fromhex("c801")) >= 4


def test_relative_ends_refuse_an_end_before_the_node():
    context = TableContext("", ({"shapes": {}},), 0)
    data = bytearray(encode_tables(_chain_tables([(0, 100), (0, 50)]), 0, context, True))
    # the second session's delta: zigzag(-50) = 99 = 0x63; make it zigzag(-100) = 199 (c7 01)
    at = data.index(bytes([0x63]), data.index(bytes.fromhex("a00f")) + 2)
    data[at : at + 1] = bytes.fromhex("c701")
    with pytest.raises(SeqkvError, match=r"trie table is damaged \(a session ends before"):
        decode_tables(bytes(data), 0, "x", context, relative_ends=True)
    with pytest.raises(SeqkvError, match="not a version-2 table"):
        decode_tables(encode_tables(_tables(), 0), 0, "x", context, relative_ends=True)
