"""One session, one small file: compress writes the compact layout (format 1.2) by default,
and every command that reads or grows an archive takes it. Many sessions: `--layout compact`
and `archive compact` write a compact archive (format 1.8), read and grown the same way."""

from __future__ import annotations

import pytest

from archive.test_archive import PREFIX, _add_process, assert_exact, invoke
from seqkv_cli.archive import Archive, compress_captures
from seqkv_cli.container import open_container
from seqkv_cli.container.compact_reader import CompactReader
from seqkv_cli.container.format import REPLAY_MINOR
from seqkv_cli.kvcapture.api import capture
from seqkv_cli.kvcapture.capture_file import load_capture
from seqkv_cli.trie import load_trie


@pytest.fixture(scope="module")
def caps(tiny_lm, tmp_path_factory):
    folder = tmp_path_factory.mktemp("compactcaps")
    for i in range(3):
        (folder / f"c{i}.txt").write_text(PREFIX + f"User {i}: what do {i * 3} pumps need?")
    results = capture(sorted(str(p) for p in folder.glob("*.txt")), model=tiny_lm, out=folder)
    return [r.path for r in results]


@pytest.mark.parametrize("codec", ["seq", "seq-fast"])
def test_one_session_is_a_compact_file_within_the_whole_file_bound(caps, tiny_lm, tmp_path, codec):
    path = tmp_path / "one.skv"
    result = invoke("compress", caps[0], "-o", path, "--codec", codec, "--model", tiny_lm.folder)
    assert result.exit_code == 0, result.output
    assert "compact layout" in result.stdout
    cap = load_capture(caps[0])
    with open_container(path) as reader:
        assert isinstance(reader, CompactReader)
        framing = path.stat().st_size - reader.sections[0].length
    assert framing <= 64 - 1 + len(cap.session_id)  # 43 bytes + the id, at this length
    # issue 14's bound for a whole one-session file: <= 1.02 x log2 PP + 512 / positions
    bits = path.stat().st_size * 8 / cap.positions
    assert bits <= 1.02 * cap.log2_ppl + 512 / cap.positions
    assert_exact(path, tiny_lm, caps[:1])
    trie = tmp_path / "trie.skv"
    compress_captures(caps[:1], trie, codec=codec, model=tiny_lm, layout="trie")
    assert trie.stat().st_size - path.stat().st_size > 500  # what the compact layout saves


def test_layout_trie_keeps_provenance_and_compact_does_not(caps, tiny_lm, tmp_path):
    compress_captures(caps[:1], tmp_path / "c.skv", codec="seq", model=tiny_lm)
    compress_captures(caps[:1], tmp_path / "t.skv", codec="seq", model=tiny_lm, layout="trie")
    with Archive(tmp_path / "c.skv") as c, Archive(tmp_path / "t.skv") as t:
        assert "source" in t.sessions[0]["capture_meta"]
        assert "source" not in c.sessions[0]["capture_meta"]
        for key in ("id", "positions", "dtype", "shapes", "numeric_path", "log2_ppl"):
            assert c.sessions[0][key] == t.sessions[0][key], key
    info = invoke("info", tmp_path / "c.skv")
    assert info.exit_code == 0 and "compact single-session file" in info.stdout
    assert "format 1.5" in info.stdout  # a portable-fx53-v3 session (compact codes of 1.5)


def test_layout_compact_refuses_what_it_cannot_hold(caps, tiny_lm, tmp_path):
    out = tmp_path / "x.skv"
    result = invoke("compress", caps[0], "-o", out, "--codec", "turbo3", "--layout", "compact")
    assert result.exit_code == 2 and "seq or seq-fast sessions, not turbo3" in result.stderr
    result = invoke(
        "compress", caps[0], "-o", out, "--tolerance", "0.01", "--layout", "compact",
        "--model", tiny_lm.folder,
    )  # fmt: skip
    assert result.exit_code == 2 and "cannot be a compact file" in result.stderr
    assert "Traceback" not in result.output and not out.exists()
    assert list(tmp_path.iterdir()) == []  # no staging or temporary file left


def test_archive_add_expands_a_compact_file_and_keeps_its_token_bytes(caps, tiny_lm, tmp_path):
    path = tmp_path / "grow.skv"
    compress_captures(caps[:1], path, codec="seq", model=tiny_lm)
    with open_container(path) as reader:
        payload = reader.read_section("t1/tokens")
    result = invoke("archive", "add", path, caps[1], "--model", tiny_lm.folder)
    assert result.exit_code == 0, result.output
    with open_container(path) as reader:
        assert not isinstance(reader, CompactReader)
        assert reader.version == (1, REPLAY_MINOR)
        # nothing was re-encoded: the version-2 table of segment 1 is followed by the payload
        assert load_trie(reader, path).embedded[1] == payload
        assert reader.header["model"]["fingerprint"] == tiny_lm.fingerprint  # named whole
    assert_exact(path, tiny_lm, caps[:2])
    assert invoke("archive", "add", path, caps[2], "--model", tiny_lm.folder).exit_code == 0
    assert_exact(path, tiny_lm, caps)


def test_concurrent_adds_to_a_compact_file_lose_nothing(caps, tiny_lm, tmp_path):
    """One adder expands the file while the other waits on the old file's lock."""
    path = tmp_path / "race.skv"
    compress_captures(caps[:1], path, codec="seq", model=tiny_lm)
    procs = [_add_process(path, p, tiny_lm.folder) for p in caps[1:]]
    outputs = [proc.communicate(timeout=300) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outputs
    assert_exact(path, tiny_lm, caps)


def test_another_model_is_refused_by_the_fingerprint_prefix(caps, tiny_lm, tmp_path):
    from conftest import build_tiny_model

    other = build_tiny_model(tmp_path / "other", seed=99)
    path = tmp_path / "one.skv"
    compress_captures(caps[:1], path, codec="seq", model=tiny_lm)
    before = path.read_bytes()
    result = invoke("decompress", path, "-o", tmp_path / "out", "--model", other)
    assert result.exit_code == 2 and "fingerprint" in result.stderr
    result = invoke("archive", "add", path, caps[1], "--model", other)
    assert result.exit_code == 2 and "pass --model with the right one" in result.stderr
    assert path.read_bytes() == before


def test_report_pairs_a_compact_file_with_its_capture(caps, tiny_lm, tmp_path):
    """The file names its model by 8 bytes; report still finds the capture it restores."""
    import json

    path = tmp_path / "one.skv"
    compress_captures(caps[:1], path, codec="seq", model=tiny_lm)
    out = tmp_path / "r.json"
    args = ("report", caps[0], path, "--codecs", "int8", "--model", tiny_lm.folder, "--json", out)
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())["sessions"]
    archived = [r for r in rows if r["source"] == str(path)]
    assert len(archived) == 1 and archived[0]["exact"] is True
    assert archived[0]["bits_per_position"] == path.stat().st_size * 8 / archived[0]["positions"]


def test_a_restored_capture_names_its_model_whole_and_compresses_to_the_same_file(
    caps, tiny_lm, tmp_path
):
    path = tmp_path / "one.skv"
    compress_captures(caps[:1], path, codec="seq", model=tiny_lm)
    result = invoke("decompress", path, "-o", tmp_path / "out", "--model", tiny_lm.folder)
    assert result.exit_code == 0, result.output
    [restored] = (tmp_path / "out").glob("*.safetensors")
    assert load_capture(restored).meta["model_fingerprint"] == tiny_lm.fingerprint
    compress_captures([restored], tmp_path / "again.skv", codec="seq", model=tiny_lm)
    assert (tmp_path / "again.skv").read_bytes() == path.read_bytes()
    result = invoke("archive", "compact", path, "--model", tiny_lm.folder)  # a no-op rewrite
    assert result.exit_code == 0, result.output
    assert (tmp_path / "again.skv").read_bytes() == path.read_bytes()


# --- compact archives (format 1.8) ---


@pytest.mark.parametrize("codec", ["seq", "seq-fast"])
def test_several_sessions_are_a_compact_archive_that_restores_bit_for_bit(
    caps, tiny_lm, tmp_path, codec
):
    path = tmp_path / "many.skv"
    args = ("compress", *caps, "-o", path, "--codec", codec, "--layout", "compact")
    result = invoke(*args, "--model", tiny_lm.folder)
    assert result.exit_code == 0, result.output
    assert "compact archive layout" in result.stdout
    with open_container(path) as reader:
        assert isinstance(reader, CompactReader) and reader.archive
        assert reader.version == (1, 8)
        contents = load_trie(reader, path)
        payload = len(contents.embedded[1])
    assert_exact(path, tiny_lm, caps)
    trie = tmp_path / "trie.skv"
    compress_captures(caps, trie, codec=codec, model=tiny_lm, layout="trie")
    with open_container(trie) as reader:
        assert len(load_trie(reader, trie).embedded[1]) == payload  # the same token bytes
    # what the full layout spends on its superblock, JSON header, index and provenance
    assert trie.stat().st_size - path.stat().st_size > 500
    assert path.stat().st_size - payload <= 60 + 3 * 12  # header + ~a dozen bytes a session
    info = invoke("info", path, "--model", tiny_lm.folder)
    assert info.exit_code == 0 and "compact archive" in info.stdout
    listed = invoke("archive", "list", path)
    assert listed.exit_code == 0 and all(load_capture(c).session_id in listed.stdout for c in caps)


def _turns(path, lm, ids, n, load="small"):
    import seqkv_cli as seqkv

    with seqkv.open_archive(path, model=lm, load=load) as arc:
        for k in range(1, n + 1):
            arc.add(f"agent/turn-{k}", ids[: 24 * k])


@pytest.fixture(scope="module")
def turn_ids(caps):
    return load_capture(caps[0]).tokens.tolist()


@pytest.mark.parametrize("load", ["small", "fast"])
def test_compact_merges_an_agents_turns_into_one_node_and_grows_again(
    tiny_lm, tmp_path, turn_ids, load
):
    import seqkv_cli as seqkv
    from seqkv_cli.archive import compact

    path = tmp_path / "agent.skv"
    _turns(path, tiny_lm, turn_ids, 4, load)
    before = path.stat().st_size
    res = compact(path, model=tiny_lm)
    assert res.layout == "compact archive" and path.stat().st_size < before / 2
    with open_container(path) as reader:
        assert reader.archive
        contents = load_trie(reader, path)
        payload = contents.embedded[1]
    assert len(contents.nodes) == 1  # the chain is one node; turns 1-3 end inside it
    assert [(s.end_node, s.end) for s in contents.sessions] == [(0, 24 * k) for k in range(1, 5)]
    with seqkv.open_archive(path, model=tiny_lm) as arc:
        for k in (1, 2, 4):
            restored = arc.load_capture(f"agent/turn-{k}")
            assert restored.tokens.tolist() == turn_ids[: 24 * k]
        assert {s.load for s in arc.sessions()} == {load}
        arc.add("agent/turn-5", turn_ids[:120])  # the file becomes the full layout again
    with open_container(path) as reader:
        assert not isinstance(reader, CompactReader)
        assert load_trie(reader, path).embedded[1] == payload  # segment 1's bytes unchanged
    with seqkv.open_archive(path, model=tiny_lm) as arc:
        assert arc.load_capture("agent/turn-3").tokens.tolist() == turn_ids[:72]
        assert arc.load_capture("agent/turn-5").tokens.tolist() == turn_ids[:120]


def test_compact_layout_choices_and_refusals(caps, tiny_lm, tmp_path, turn_ids):
    path = tmp_path / "agent.skv"
    _turns(path, tiny_lm, turn_ids, 3)
    result = invoke("archive", "compact", path, "--layout", "trie", "--model", tiny_lm.folder)
    assert result.exit_code == 0 and "trie layout" in result.stdout, result.output
    with open_container(path) as reader:
        assert not isinstance(reader, CompactReader)
        assert len(load_trie(reader, path).nodes) == 1  # merged all the same
    result = invoke("archive", "compact", path, "--model", tiny_lm.folder)
    assert result.exit_code == 0 and "compact archive layout" in result.stdout, result.output
    result = invoke("archive", "compact", path, "--layout", "smallest")
    assert result.exit_code == 2 and "unknown layout 'smallest'" in result.stderr
    # sessions that keep more than tokens (a residual): compact keeps the full layout, and
    # insisting on the compact one is refused in one line, the archive untouched
    # captures the portable recompute reproduces keep nothing but tokens: a compact archive
    kept = tmp_path / "kept.skv"
    compress_captures(caps, kept, codec={"id": "seq", "residual": "lossless"}, model=tiny_lm)
    args = ("archive", "compact", kept, "--layout", "compact", "--model", tiny_lm.folder)
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    with open_container(kept) as reader:
        assert reader.archive
    assert_exact(kept, tiny_lm, caps)
    # sessions that keep their K/V (a per-vector codec): insisting on the compact layout is
    # refused in one line, the archive untouched
    blocks = tmp_path / "blocks.skv"
    compress_captures(caps, blocks, codec="raw")
    before = blocks.read_bytes()
    result = invoke("archive", "compact", blocks, "--layout", "compact")
    assert result.exit_code == 2 and "cannot be a compact file" in result.stderr
    assert "Traceback" not in result.output and blocks.read_bytes() == before


def _forged(tmp_path, tiny_lm, turn_ids, edit):
    """A compact archive of three turns whose table `edit` rewrites (checksums made valid)."""
    from seqkv_cli.archive import compact
    from seqkv_cli.container.compact import write_compact_archive

    path = tmp_path / "agent.skv"
    _turns(path, tiny_lm, turn_ids, 3)
    compact(path, model=tiny_lm)
    with open_container(path) as reader:
        head, raw = reader.compact, reader.read_section("t1/index")
        payload = load_trie(reader, path).embedded[1]
    table = raw[: len(raw) - len(payload)]
    assert edit(table) != table  # the forgery found what it rewrites
    path.unlink()
    write_compact_archive(path, head, edit(table), payload)
    return path


@pytest.mark.parametrize(
    "edit, words",
    [
        (lambda t: bytes([0x2A]) + t[1:], "not a compact archive's table"),  # + JSON flag
        (lambda t: b"SKTI" + t, "not a compact archive's table"),
        (lambda t: t[:-3], "trie table is damaged"),
        (lambda t: t + b"\x00", "trie table is damaged"),
        # the first session's code (end node +1, partial: 5) and end, zigzag(24) = 0x30,
        # made zigzag(88) = b0 01: past its node of 72 tokens
        (lambda t: t.replace(b"\x05\x30", b"\x05\xb0\x01", 1), "outside its node"),
        (lambda t: t.replace(b"agent/turn-1", b"agent/turn-2", 1), "appears twice"),
    ],
)
def test_a_compact_archive_with_a_hostile_table_is_refused_in_one_line(
    tiny_lm, tmp_path, turn_ids, edit, words
):
    path = _forged(tmp_path, tiny_lm, turn_ids, edit)
    result = invoke("archive", "list", path)
    result2 = invoke("decompress", path, "-o", tmp_path / "out", "--model", tiny_lm.folder)
    for r in (result, result2):
        assert r.exit_code != 0 and words in r.stderr, r.output
        assert "Traceback" not in r.output and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_a_turn_that_ends_inside_the_chain_is_checked_by_its_log2_pp(tiny_lm, tmp_path, turn_ids):
    """A session that ends inside its node is decoded only that far, short of the node's
    token checksum; what catches a decoder that goes astray there is the session's log2 PP,
    which its restored surprisal must give to the thousandth of a bit. Here the decoder's
    distribution is skewed (as a machine that computes other logits would): refused."""
    import numpy as np

    import seqkv_cli as seqkv
    from seqkv_cli.archive import compact
    from seqkv_codecs.sequential import probability

    path = tmp_path / "agent.skv"
    _turns(path, tiny_lm, turn_ids, 3)
    compact(path, model=tiny_lm)
    real = probability.frequencies_from_logits

    def skewed(logits, precision):
        return real(np.roll(np.asarray(logits), 1, axis=-1), precision)

    with seqkv.open_archive(path, model=tiny_lm) as arc:
        assert arc.load_capture("agent/turn-1").tokens.tolist() == turn_ids[:24]
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(probability, "frequencies_from_logits", skewed)
            with pytest.raises(seqkv.SeqkvError, match="log2 PP") as info:
                arc.load_capture("agent/turn-1")
            assert "damaged" in str(info.value)
