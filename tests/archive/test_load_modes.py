"""Load modes per session (format 1.7): a `seq` archive keeps a turn `seq-fast`, the other way
round, restores each node by its own segment's codec, and says how each session loads."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import seqkv_cli as seqkv
from archive.test_archive import PREFIX, assert_exact, invoke
from conftest import token_ids
from seqkv_cli.archive import Archive, compress_captures
from seqkv_cli.container import open_container
from seqkv_cli.container.format import REPLAY_MINOR
from seqkv_cli.errors import SeqkvError
from seqkv_cli.kvcapture.api import capture
from seqkv_cli.sequential.load_modes import mode_codec, segment_codec
from seqkv_cli.sequential.registry import resolve_codec

GOLDEN = Path(__file__).resolve().parent.parent / "golden"


def _same(a, b) -> bool:
    return (
        torch.equal(a.tokens, b.tokens)
        and all(torch.equal(x, y) for x, y in zip(a.keys, b.keys, strict=True))
        and all(torch.equal(x, y) for x, y in zip(a.values, b.values, strict=True))
    )


TURNS = [(30, "small"), (60, "fast"), (90, "small"), (75, "fast"), (120, "fast")]


def test_turns_of_both_modes_restore_as_an_all_small_archive_does(tmp_path, user_model, tiny_lm):
    ids = token_ids(120)
    mixed, small = tmp_path / "mixed.skv", tmp_path / "small.skv"
    with seqkv.open_archive(mixed, model=user_model) as arc:
        for k, (n, mode) in enumerate(TURNS):
            arc.add(f"t{k}", ids[:, :n], load=mode)
        modes = {s.id: s.load for s in arc.sessions()}
    with seqkv.open_archive(small, model=user_model) as arc:
        for k, (n, _) in enumerate(TURNS):
            arc.add(f"t{k}", ids[:, :n])
        assert {s.load for s in arc.sessions()} == {"small"}
    # t0 was coded small; every later turn's path crosses both kinds of segment
    assert modes == {"t0": "small", "t1": "mixed", "t2": "mixed", "t3": "mixed", "t4": "mixed"}
    with Archive(mixed, model=tiny_lm) as a, Archive(small, model=tiny_lm) as b:
        assert a.reader.version == (1, REPLAY_MINOR)
        assert a.trie.codecs == {2: "seq-fast", 5: "seq-fast"}  # t3 is a prefix: no new node
        assert not b.trie.codecs
        index = a.reader.read_section("t2/index")
        assert index[0] & 0xC0 == 0x80 and b"seq-fast" in index[:16]  # flag bit 5, the id
        for ea, eb in zip(a.sessions, b.sessions, strict=True):
            assert _same(a.restore(ea), b.restore(eb)), ea["id"]
    # the fast turns' new tokens are packed ids (an entropy table would cost more)
    with open_container(mixed) as reader:
        raw = reader.read_section("t2/index")
    assert b"\x50\x1e" in raw  # tag 0x50, 30 ids


def test_an_archive_opened_fast_stores_every_session_fast(tmp_path, user_model):
    ids = token_ids(80, seed=1)
    path = tmp_path / "fast.skv"
    with seqkv.open_archive(path, model=user_model, load="fast") as arc:
        arc.add("a", ids[:, :50])
        arc.add("b", ids[:, :80])
        arc.add("c", ids[:, :65], load="small")  # a prefix: no new node, no codec named
        assert [s.load for s in arc.sessions()] == ["fast", "fast", "fast"]
        got = arc.load_capture("b")
    with Archive(path) as a:
        assert a.codec.codec_id == "seq-fast" and not a.trie.codecs
    with seqkv.open_archive(tmp_path / "ref.skv", model=user_model) as ref:
        ref.add("b", ids[:, :80])
        assert _same(got, ref.load_capture("b"))


def test_a_fast_replayed_session_loads_without_seqkvs_model(tmp_path, user_model, monkeypatch):
    """The replay is the load: tokens are read, the user's model runs the recorded calls."""
    ids = token_ids(48, seed=2)
    with torch.inference_mode():
        cache = user_model(ids, use_cache=True).past_key_values
    path = tmp_path / "r.skv"
    with seqkv.open_archive(path, model=user_model, load="fast") as arc:
        arc.add("seed", ids[:, :20])
        report = arc.add("turn", ids, cache=cache)
        arc.add("other", token_ids(30, seed=3), load="small")
    assert report.kv_strategy == "replay"

    def no_restore(self, *args, **kwargs):
        raise AssertionError("a fast replayed session must not be restored through the model")

    monkeypatch.setattr(Archive, "restore", no_restore)  # where every restore goes
    with seqkv.open_archive(path, model=user_model) as arc:
        loaded = arc.load("turn")
        with pytest.raises(AssertionError, match="must not be restored"):
            arc.load("other")  # a small session has to step the model for its tokens
    for mine, theirs in zip(loaded.layers, cache.layers, strict=True):
        assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)


def test_load_is_one_of_two_modes(tmp_path, user_model):
    with pytest.raises(SeqkvError, match=r"^load must be one of 'small', 'fast', not 'quick'$"):
        seqkv.open_archive(tmp_path / "x.skv", model=user_model, load="quick")
    arc = seqkv.open_archive(tmp_path / "x.skv", model=user_model)
    with pytest.raises(SeqkvError, match="load must be one of"):
        arc.add("a", token_ids(10), load="")
    assert not (tmp_path / "x.skv").exists()


def test_a_format_1_6_file_takes_only_its_own_mode(tmp_path):
    """A 1.6 reader would read a segment naming a codec as damaged: refused, file untouched."""
    path = tmp_path / "turns.skv"
    shutil.copy(GOLDEN / "records-v1" / "api-turns.skv", path)
    model = str(GOLDEN / "seq-v1" / "model")
    before = path.read_bytes()
    with seqkv.open_archive(path, model=model) as arc:
        tokens = arc.tokens("agent/turn-3")
        with pytest.raises(SeqkvError) as info:
            arc.add("agent/turn-4", [*tokens, 7, 8, 9], load="fast")
        assert path.read_bytes() == before
        assert "format 1.6" in str(info.value) and "archive compact" in str(info.value)
        assert "\n" not in str(info.value)
        arc.add("agent/turn-4", [*tokens, 7, 8, 9], load="small")  # its own mode: appended
        assert arc.tokens("agent/turn-4")[-3:] == [7, 8, 9]
    with open_container(path) as reader:
        assert reader.version == (1, 6)


def test_segment_codecs_are_model_codecs_of_a_model_archive():
    seq = resolve_codec("seq")
    assert segment_codec(seq, None, 1) is seq and mode_codec(seq, "small") is seq
    fast = mode_codec(seq, "fast")
    assert fast.codec_id == "seq-fast" and fast.numerics == seq.numerics
    for bad in ("zzz", "int8", "delta-topk"):
        with pytest.raises(SeqkvError, match=rf"segment 3 names codec '{bad}'.*damaged or newer"):
            segment_codec(seq, bad, 3)
    with pytest.raises(SeqkvError, match="cannot code a segment"):
        segment_codec(resolve_codec("int8"), "seq", 2)


@pytest.fixture(scope="module")
def caps(tiny_lm, tmp_path_factory):
    folder = tmp_path_factory.mktemp("modecaps")
    for i in range(3):
        (folder / f"m{i}.txt").write_text(PREFIX + f"User {i}: which of {i * 5} gauges?")
    results = capture(sorted(str(p) for p in folder.glob("*.txt")), model=tiny_lm, out=folder)
    return [r.path for r in results]


def test_archive_add_takes_a_load_mode_and_list_shows_it(caps, tiny_lm, tmp_path):
    path = tmp_path / "cli.skv"
    compress_captures(caps[:1], path, codec="seq", model=tiny_lm, layout="trie")
    result = invoke("archive", "add", path, caps[1], "--load", "fast", "--model", tiny_lm.folder)
    assert result.exit_code == 0, result.output
    result = invoke("archive", "add", path, caps[2], "--load", "slow", "--model", tiny_lm.folder)
    assert result.exit_code != 0
    assert "load must be one of 'small', 'fast', not 'slow'" in result.output
    assert "Traceback" not in result.output
    listing = invoke("archive", "list", path)
    assert listing.exit_code == 0, listing.output
    assert "load" in listing.stdout and "small" in listing.stdout and "mixed" in listing.stdout
    assert_exact(path, tiny_lm, caps[:2])


def test_compact_codes_every_session_in_one_mode(tmp_path, user_model, tiny_lm, monkeypatch):
    """A tokens-only archive is compacted from its tokens: no capture file is written."""
    from seqkv_cli.archive import compact, compaction

    def no_files(*args, **kwargs):
        raise AssertionError("a tokens-only archive must not be decompressed to capture files")

    monkeypatch.setattr(compaction, "decompress", no_files)

    ids = token_ids(100, seed=4)
    path = tmp_path / "c.skv"
    with seqkv.open_archive(path, model=user_model) as arc:
        for k, (n, mode) in enumerate([(40, "small"), (70, "fast"), (100, "small")]):
            arc.add(f"t{k}", ids[:, :n], load=mode)
        before = {s.id: arc.load_capture(s.id) for s in arc.sessions()}
    for load, want in ((None, "small"), ("fast", "fast"), ("small", "small")):
        compact(path, model=tiny_lm, load=load)
        with seqkv.open_archive(path, model=user_model) as arc:
            assert {s.load for s in arc.sessions()} == {want}, load
            for sid, cap in before.items():
                assert _same(arc.load_capture(sid), cap), (load, sid)
    with pytest.raises(SeqkvError, match="load must be one of"):
        compact(path, model=tiny_lm, load="tiny")


def _counting(monkeypatch, lm):
    """Count the tokens the canonical forward is fed (the archive's own forward object)."""
    from seqkv_cli.kvcapture.engine import canonical_model
    from seqkv_cli.runtime.numerics import DEFAULT

    canon = canonical_model(lm, DEFAULT)
    fed = []
    forward = canon.forward

    def counted(state, ids):
        fed.append(len(ids))
        return forward(state, ids)

    monkeypatch.setattr(canon, "forward", counted)
    return fed


@pytest.mark.parametrize("mode", ["small", "fast"])
def test_a_turn_that_extends_the_last_one_runs_only_its_new_tokens(
    tmp_path, tiny_lm, monkeypatch, mode
):
    """One handle keeps the state of the session it added last; the next turn forks it. The
    file is the same bytes as turns added by a fresh handle each (a full prefill each)."""
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1796200000")
    ids = token_ids(160, seed=5)
    cuts = [40, 80, 120, 160]
    warm, cold = tmp_path / "warm.skv", tmp_path / "cold.skv"
    fed = _counting(monkeypatch, tiny_lm)
    with seqkv.open_archive(warm, model=tiny_lm, load=mode) as arc:
        per_turn = []
        for k, n in enumerate(cuts):
            fed.clear()
            arc.add(f"turn-{k}", ids[:, :n])
            per_turn.append(sum(fed))
    for k, n in enumerate(cuts):
        with seqkv.open_archive(cold, model=tiny_lm, load=mode) as arc:
            fed.clear()
            arc.add(f"turn-{k}", ids[:, :n])
            assert sum(fed) >= n, k  # a fresh handle prefills the whole session
    # turn 2 continues the state turn 1's add left; turn 3 turn 2's (turn 0 made the file,
    # turn 1 had nothing to continue)
    assert per_turn[2] == per_turn[3] == 40 and per_turn[1] >= 80
    assert warm.read_bytes() == cold.read_bytes()


def test_a_warm_state_is_only_used_for_a_session_that_extends_it(tmp_path, tiny_lm, monkeypatch):
    ids, other = token_ids(90, seed=6), token_ids(90, seed=7)
    fed = _counting(monkeypatch, tiny_lm)
    path = tmp_path / "w.skv"
    with seqkv.open_archive(path, model=tiny_lm) as arc:
        arc.add("a", ids[:, :30])
        arc.add("b", ids[:, :60])  # now held: b
        fed.clear()
        arc.add("c", other[:, :50])  # does not extend b: a whole prefill
        assert sum(fed) >= 50
        fed.clear()
        arc.add("d", ids[:, :90])  # extends b, but c was added last: a whole prefill
        assert sum(fed) >= 90
        fed.clear()
        arc.add("e", ids[:, :90].flip(1))  # held d's first token differs
        assert sum(fed) >= 90
        restored = {s.id: arc.tokens(s.id) for s in arc.sessions()}
    assert restored["d"] == ids[0].tolist() and restored["c"] == other[0, :50].tolist()
