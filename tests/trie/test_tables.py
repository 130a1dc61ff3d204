"""Trie tables read their varints with the shared codec and keep their own refusals."""

from __future__ import annotations

import pytest

from seqkv_cli.errors import SeqkvError
from seqkv_cli.trie.tables import (
    MAGIC,
    VERSION,
    Node,
    SegmentTables,
    SessionRecord,
    decode_tables,
    encode_tables,
)


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
