"""One session, one small file: compress writes the compact layout (format 1.2) by default,
and every command that reads or grows an archive takes it."""

from __future__ import annotations

import pytest

from archive.test_archive import PREFIX, _add_process, assert_exact, invoke
from seqkv_cli.archive import Archive, compress_captures
from seqkv_cli.container import FORMAT_MINOR, open_container
from seqkv_cli.container.compact_reader import CompactReader
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
    result = invoke("compress", *caps[:2], "-o", out, "--codec", "seq", "--layout", "compact")
    assert result.exit_code == 2 and "one seq or seq-fast session, not 2" in result.stderr
    result = invoke("compress", caps[0], "-o", out, "--codec", "turbo3", "--layout", "compact")
    assert result.exit_code == 2 and "not codec turbo3" in result.stderr
    result = invoke(
        "compress", caps[0], "-o", out, "--tolerance", "0.01", "--layout", "compact",
        "--model", tiny_lm.folder,
    )  # fmt: skip
    assert result.exit_code == 2 and "cannot be a compact single-session file" in result.stderr
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
        assert not isinstance(reader, CompactReader) and reader.version == (1, FORMAT_MINOR)
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
