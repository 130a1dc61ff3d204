"""Replay records in binary in a version-2 segment table (format 1.9): what each costs, what it
inherits, and every hostile field refused in one line."""

from __future__ import annotations

import dataclasses

import pytest
from test_tables import _grow

from seqkv_cli.errors import SeqkvError
from seqkv_cli.trie.replay_records import MAX_ARCHIVE_RUNS, ReplayContext, binary_form
from seqkv_cli.trie.tables import (
    FLAG_REPLAY,
    FRESH,
    Node,
    SegmentTables,
    SessionRecord,
    TableContext,
    decode_tables,
    encode_tables,
)

PROFILE = {"dtype": "bf16", "numeric_path": "p", "shapes": {}, "capture_meta": {}}
ENV = {
    "model_dtype": "float32",
    "device": "cpu",
    "attention": "sdpa",
    "torch": "2.13.0+cpu",
    "transformers": "5.25.0",
}


def record(calls, digest: str = "ab" * 32, **env) -> dict:
    return {"version": 1, "calls": calls, "cache_dtype": "fp32", "sha256": digest, **ENV, **env}


def turn_calls(k: int) -> list[list[int]]:
    """An agent's turn k (1-based) continued from turn k - 1: a prefill of 90, 9 steps."""
    return [[90, 1], [1, 9]] * k


def _turn(k: int, rec: dict | None, extra: dict | None = None) -> SegmentTables:
    node = Node(-1, 0, 100, 60, 7) if k == 0 else Node(k - 1, 100, 100, 60, 7)
    extra = dict(extra or {}, **({"replay": rec} if rec else {}))
    return SegmentTables(
        [node], [SessionRecord(f"run-7/turn-{k + 1}", k, 100, 4200, 0, extra)], [PROFILE]
    )


def _damaged(data: bytes, context: TableContext = FRESH) -> str:
    with pytest.raises(SeqkvError) as info:
        decode_tables(data, 0, "x", context)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_a_turn_stores_what_is_new_and_reads_back_as_the_json_record():
    turns = [_turn(k, record(turn_calls(k + 1), f"{k:02x}" * 32)) for k in range(3)]
    written, read = _grow(turns)
    # the first stores the environment (cache dtype code 2, five strings), its calls as
    # generate's (a prefill of 90, 9 steps) and 16 bytes of digest; the next inherit the
    # environment and continue the turn before (record | continues | steps: 0x19)
    env = b"\x02\x07float32\x03cpu\x04sdpa\x0a2.13.0+cpu\x065.25.0"
    assert written[0].endswith(b"\x13" + env + b"\x5a\x09" + b"\x00" * 16)
    assert written[1].endswith(b"\x19\x5a\x09" + b"\x01" * 16)
    assert written[1][0] == 0x80 | FLAG_REPLAY | 2  # inherited profile, replay records
    assert len(written[2]) == len(written[1]) == 34  # 19 of them the record
    for k, tables in enumerate(read):
        got = tables.sessions[0].extra["replay"]
        assert got == record(turn_calls(k + 1), f"{k:02x}" * 16)  # 16 bytes of digest kept


def test_a_shorter_session_after_a_longer_one_takes_its_first_calls():
    """`archive compact` inserts the longest session first: the turn before it names it as
    its parent and drops the calls it does not have."""
    long_, short = record(turn_calls(3)), record(turn_calls(2), "cd" * 32)
    two = SegmentTables(
        [Node(-1, 0, 300, 60, 7)],
        [
            SessionRecord("t3", 0, 300, 1, 0, {"replay": long_}),
            SessionRecord("t2", 0, 200, 1, 0, {"replay": short}),
        ],
        [PROFILE],
    )
    (data,), (back,) = _grow([two])
    assert b"\x05\x01\x0a\x00" + b"\xcd" * 16 in data  # parent 1 back, its last 10 calls dropped
    assert back.sessions[1].extra["replay"]["calls"] == turn_calls(2)


def test_records_that_binary_cannot_hold_stay_json_and_old_files_keep_json():
    odd = dict(record([[5, 1]]), extra_key=1)
    (data,), (back,) = _grow([_turn(0, odd)])
    assert not data[0] & FLAG_REPLAY and back.sessions[0].extra["replay"] == odd
    # a file older than 1.9: its readers know JSON records only
    (data,), (back,) = _grow(
        [_turn(0, record([[5, 1]]))], dataclasses.replace(FRESH, binary_replay=False)
    )
    assert data[0] == 0x20 | 8 | 4 or not data[0] & FLAG_REPLAY
    assert back.sessions[0].extra["replay"] == record([[5, 1]])  # all 64 hex digits
    for bad in (
        {**record([[5, 1]]), "sha256": "AB" * 32},
        {**record([[5, 1]]), "cache_dtype": "int8"},
    ):
        assert binary_form(bad) is None


def _one(rest: bytes, context: TableContext = FRESH, flags: int = 0) -> bytes:
    """A one-node, one-session version-2 table whose replay block is `rest`."""
    head = bytes([0x80 | FLAG_REPLAY | 2 | flags, 1, 1])
    return head + b"\x00\x00\x05\x00\x00\x00" + b"\x04\xff\xff" + b"\x00\x01s" + rest


ENV_BYTES = b"\x02\x01a\x01b\x01c\x01d\x01e"
CHAIN = TableContext(
    profiles=(PROFILE,), replay=ReplayContext((None, ((5, 1),)), ("fp32", "a", "b", "c", "d", "e"))
)

FIRST = dataclasses.replace(CHAIN, replay=ReplayContext((), CHAIN.replay.environment))


@pytest.mark.parametrize(
    ("rest", "context", "words"),
    [
        (b"\x01\x01\x05\x01" + b"\x00" * 16, FRESH, "inherits an environment no record"),
        (
            b"\x03\x07" + ENV_BYTES[1:] + b"\x01\x05\x01" + b"\x00" * 16,
            FRESH,
            "unknown cache dtype",
        ),
        (b"\x03\x02\x41" + b"a" * 65, FRESH, "environment string is too long"),
        (b"\x03\x02\x01\xff" + ENV_BYTES[3:] + b"\x01\x05\x01" + b"\x00" * 16, FRESH, "not UTF-8"),
        (b"\x05\x00\x00\x00" + b"\x00" * 16, CHAIN, "0 sessions back, which is no session"),
        (b"\x05\x03\x00\x00" + b"\x00" * 16, CHAIN, "3 sessions back, which is no session"),
        (b"\x05\x02\x00\x00" + b"\x00" * 16, CHAIN, "parent has no replay record"),
        (b"\x05\x01\x01\x00" + b"\x00" * 16, CHAIN, "drops more calls than its parent has"),
        (b"\x01\x00" + b"\x00" * 16, CHAIN, "schedule is empty"),
        (b"\x01\x01\x00\x01" + b"\x00" * 16, CHAIN, "a forward call of no tokens"),
        (b"\x01\x01\x05\x00" + b"\x00" * 16, CHAIN, "a forward call of no tokens"),
        (b"\x01\x81\x20", CHAIN, "more than 4096 runs"),
        (b"\x01\x01\x05\x01" + b"\x00" * 15, CHAIN, "truncated"),
        (b"\x02", CHAIN, "without its record bit"),
        (b"\x21\x01\x05\x01" + b"\x00" * 16, CHAIN, "features of a newer seqkv; upgrade seqkv"),
        (b"\x0d\x01\x00\x01\x05\x01" + b"\x00" * 16, CHAIN, "names its parent twice"),
        (b"\x09\x05\x00" + b"\x00" * 16, FIRST, "1 sessions back, which is no session"),
        (b"\x11\x00\x03" + b"\x00" * 16, CHAIN, "a forward call of no tokens"),
    ],
)
def test_hostile_records_are_refused_in_one_line(rest, context, words):
    assert words in _damaged(_one(rest), context)


def test_the_parent_is_read_from_the_archive_before_and_a_record_is_not_stored_twice():
    good = _one(b"\x05\x01\x00\x01\x01\x03" + b"\x11" * 16)
    back = decode_tables(good, 0, "x", CHAIN)
    assert back.sessions[0].extra["replay"]["calls"] == [[5, 1], [1, 3]]
    assert back.sessions[0].extra["replay"]["device"] == "b"
    # one session with a JSON record and a binary one: a forged table is refused
    one = _turn(0, None, {"replay": record([[5, 1]])})
    forged = encode_tables(one, 0, dataclasses.replace(FRESH, binary_replay=False))
    assert forged[0] & 0xE0 == 0x20  # the record in the (zlib'd) JSON block, as 1.7 keeps it
    block = b"\x03" + ENV_BYTES + b"\x01\x05\x01" + b"\x00" * 16
    both = bytes([0x80 | FLAG_REPLAY | forged[0] & 0x1F]) + forged[1:] + block
    assert "replay record twice" in _damaged(both)


def test_an_archive_whose_records_expand_past_the_budget_is_refused():
    runs = tuple((k % 7 + 1, 1) for k in range(4096))  # no two adjacent alike: 4,096 runs
    full = ReplayContext((runs,), ("fp32", "a", "b", "c", "d", "e"), MAX_ARCHIVE_RUNS - 4095)
    context = TableContext(profiles=(PROFILE,), replay=full)
    assert "expand to more than" in _damaged(_one(b"\x05\x01\x00\x00" + b"\x00" * 16), context)
    # and no writer makes such a file: the add is refused before anything is written
    rec = record([[k % 7 + 1, 1] for k in range(4096)])
    with pytest.raises(SeqkvError, match="would expand to more than"):
        encode_tables(_turn(0, rec), 0, context)


def test_random_damage_to_a_table_with_records_is_one_line_or_a_clean_read():
    """Every byte of three turns' tables (environment stored, then inherited; parents; steps)
    set to random values, 3,000 times: a read either succeeds or raises one SeqkvError line,
    never another exception; what it reads is records of the JSON form."""
    import random

    from seqkv_cli.trie.replay_records import binary_form

    turns = [_turn(k, record(turn_calls(k + 1), f"{k:02x}" * 32)) for k in range(3)]
    written, _ = _grow(turns)
    context = FRESH.after(turns[0]).after(turns[1])
    rng = random.Random(51)
    for _ in range(3000):
        data = bytearray(written[2])
        for _ in range(rng.randint(1, 3)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        try:
            tables = decode_tables(bytes(data), 2, "x", context)
        except SeqkvError as exc:
            assert "\n" not in str(exc)
            continue
        for rec in tables.sessions:
            got = rec.extra.get("replay")
            assert got is None or binary_form(got) is not None
