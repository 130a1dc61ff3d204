"""User metadata (`add(meta=...)`, `add_many`) is bounded where it enters, by the limits the
archive's reader applies: refused in one line (never a RecursionError), and nothing is
written; metadata at the limit is stored and comes back as it was."""

from __future__ import annotations

import math

import pytest

import seqkv_cli as seqkv
from seqkv_cli.errors import SeqkvError

IDS = [5, 6, 7, 8]
# The trie reader refuses session names nesting deeper than 32 levels (trie.tables), and the
# user's dict sits four levels down in them; it allows 64 KiB of names a session.
MAX_META_DEPTH = 28
MAX_META_BYTES = 65_536


def nested(levels: int, leaf=1) -> dict:
    """`levels` dicts, one inside the other: {"k": {"k": ... {"k": leaf}}}."""
    meta = leaf
    for _ in range(levels):
        meta = {"k": meta}
    return meta


@pytest.fixture()
def archive(tmp_path, tiny_lm):
    """An archive with one session in it (so a refusal must leave the file as it was)."""
    path = tmp_path / "m.skv"
    with seqkv.open_archive(path, model=tiny_lm) as arc:
        arc.add("first", IDS)
        before = path.read_bytes()
        yield arc
        assert path.read_bytes() == before, "a refused add changed the file"
        assert [s.id for s in arc.sessions()] == ["first"]


def refused(arc, meta) -> str:
    with pytest.raises(SeqkvError) as caught:
        arc.add("second", IDS, meta=meta)
    message = str(caught.value)
    assert "\n" not in message and len(message) < 300, message
    return message


def test_5000_deep_metadata_is_refused_in_one_line_not_a_recursion_error(archive):
    message = refused(archive, nested(5000))
    assert f"deeper than {MAX_META_DEPTH} levels" in message
    deep_list: list = []
    for _ in range(5000):
        deep_list = [deep_list]
    assert "deeper than" in refused(archive, {"k": {"list": deep_list}})


def test_one_level_past_the_limit_is_refused(archive):
    assert "deeper than" in refused(archive, nested(MAX_META_DEPTH + 1))
    assert "deeper than" in refused(archive, nested(MAX_META_DEPTH, leaf={}))


def test_an_oversize_blob_and_a_huge_string_are_refused(archive):
    assert f"at most {MAX_META_BYTES:,}" in refused(archive, {"blob": "x" * MAX_META_BYTES})
    many = {f"key-{i}": i for i in range(MAX_META_BYTES // 8)}
    assert f"at most {MAX_META_BYTES:,}" in refused(archive, many)
    assert f"at most {MAX_META_BYTES:,}" in refused(archive, {"k": {"s": "y" * 10**7}})


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nan_and_infinity_are_refused(archive, bad):
    assert "NaN or infinity" in refused(archive, {"score": bad})
    assert "NaN or infinity" in refused(archive, {"k": {"score": [1.0, bad]}})


@pytest.mark.parametrize(
    ("meta", "says"),
    [
        ({1: "x"}, "string keys"),
        ({"k": {2: "x"}}, "non-string key 2"),
        ({"k": {"s": {1, 2}}}, "is a set"),
        ({"k": {"o": object()}}, "is a object"),
        ({"k": {"b": b"raw"}}, "is a bytes"),
        ({"k": {"t": (1, 2)}}, "is a tuple"),
        ({"k": {"s": "\ud800"}}, "not valid Unicode"),
        ({"k": None}, "values must be str"),
        ([("k", 1)], "must be a dict"),
    ],
)
def test_values_json_cannot_hold_exactly_are_refused(archive, meta, says):
    assert says in refused(archive, meta)


def test_add_many_checks_every_sessions_metadata(archive):
    items = [
        {"session_id": "ok", "input_ids": IDS, "meta": {"fine": 1}},
        {"session_id": "deep", "input_ids": IDS, "meta": nested(5000)},
    ]
    with pytest.raises(SeqkvError, match="deeper than"):
        archive.add_many(items)


def test_metadata_at_the_limits_round_trips(tmp_path, tiny_lm):
    deepest = nested(MAX_META_DEPTH)
    mixed = {"k": nested(MAX_META_DEPTH - 2, leaf=[1.5, "two", True, None])}
    big = {"blob": "z" * (MAX_META_BYTES - len('{"blob": ""}'))}
    path = tmp_path / "m.skv"
    with seqkv.open_archive(path, model=tiny_lm) as arc:
        arc.add("deepest", IDS, meta=deepest)
        arc.add_many(
            [
                {"session_id": "mixed", "input_ids": [*IDS, 9], "meta": mixed},
                {"session_id": "big", "input_ids": [*IDS, 10], "meta": big},
            ]
        )
    with seqkv.open_archive(path, model=tiny_lm) as again:  # read back from the file
        assert [s.id for s in again.sessions()] == ["deepest", "mixed", "big"]
        assert again.meta("deepest") == deepest
        assert again.meta("mixed") == mixed
        assert again.meta("big") == big
        assert again.tokens("big") == [*IDS, 10]
