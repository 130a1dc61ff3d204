"""Trie archives: shared prefixes stored once, append-only add, extract, compact, resume."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from cli_run import invoke
from seqkv_cli.archive import Archive, compress_captures, same_capture
from seqkv_cli.kvcapture.api import capture
from seqkv_cli.kvcapture.capture_file import load_capture
from seqkv_cli.trie.store import chain

PREFIX = "System: you are a careful assistant who answers briefly and cites sources. " * 3


@pytest.fixture(scope="module")
def caps(tiny_lm, tmp_path_factory):
    """Seven sessions: five branch after a shared prefix, one is a prefix, one extends."""
    folder = tmp_path_factory.mktemp("triecaps")
    texts = {f"s{i}": PREFIX + f"User {i}: how do {i * 7} valves behave?" for i in range(5)}
    texts["s5"] = texts["s2"][:120]
    texts["s6"] = texts["s3"] + " And a follow-up question."
    for name, text in texts.items():
        (folder / f"{name}.txt").write_text(text)
    results = capture(
        sorted(str(p) for p in folder.glob("*.txt")), model=tiny_lm, out=folder / "caps"
    )
    return [r.path for r in results]


def restored_all(path, lm) -> dict:
    with Archive(path, model=lm) as arc:
        return {e["id"]: r for e, r in arc.restore_many(arc.sessions)}


def assert_exact(path, lm, paths) -> None:
    got = restored_all(path, lm)
    assert len(got) == len(paths)
    for p in paths:
        cap = load_capture(p)
        assert same_capture(cap, got[cap.session_id]), cap.session_id


@pytest.mark.parametrize("codec", ["seq", "seq-fast"])
def test_trie_stores_a_shared_prefix_once_and_restores_exactly(caps, tiny_lm, tmp_path, codec):
    trie = compress_captures(caps, tmp_path / "t.skv", codec=codec, model=tiny_lm)
    flat = compress_captures(caps, tmp_path / "f.skv", codec=codec, model=tiny_lm, layout="flat")
    assert_exact(tmp_path / "t.skv", tiny_lm, caps)
    assert trie.file_bytes * 3 < flat.file_bytes
    with Archive(tmp_path / "t.skv", model=tiny_lm) as arc:
        nodes = arc.trie.nodes
        positions = sum(e["positions"] for e in arc.sessions)
    assert sum(n.n_tokens for n in nodes) < 0.35 * positions
    # shortest first: s5 (a prefix of s2) and s3 (a prefix of s6) end where their nodes end
    ends = {e["id"]: (e["trie"]["node"], e["trie"]["end"]) for e in arc.sessions}
    assert all(end == nodes[node].n_tokens for node, end in ends.values())
    assert len(nodes) == 7


def test_seq_trie_token_bytes_follow_the_surprisal_of_stored_tokens(caps, tiny_lm, tmp_path):
    from seqkv_cli.trie.plan import Trie
    from seqkv_cli.trie.segment import place_sessions
    from seqkv_cli.trie.sources import Source

    compress_captures(caps, tmp_path / "t.skv", codec="seq", model=tiny_lm)
    with Archive(tmp_path / "t.skv", model=tiny_lm) as arc:
        token_bytes = len(arc.read_part(1, "tokens"))
    trie = Trie()
    place_sessions(trie, [Source.from_path(p) for p in caps])
    bits = 0.0
    for node in trie.nodes:  # each stored token costs its surprisal under its own prefix
        surprisal = load_capture(caps[node.creator]).surprisal
        stop = node.start + len(node.tokens)
        bits += (np.log2(258) if node.start == 0 else 0.0) + float(
            surprisal[max(node.start - 1, 0) : stop - 1].sum()
        )
    assert abs(token_bytes * 8 - bits) < 0.02 * bits + 8 * 2 * len(trie.nodes)


def test_add_appends_only_new_tokens_and_keeps_old_bytes(caps, tiny_lm, tmp_path):
    path = tmp_path / "a.skv"
    compress_captures(caps[:2], path, codec="seq", model=tiny_lm)
    before = path.read_bytes()
    for p in caps[2:]:
        result = invoke("archive", "add", path, p, "--model", tiny_lm.folder)
        assert result.exit_code == 0, result.output
    after = path.read_bytes()
    # append-only: everything before the old commit is untouched except the commit slots
    assert after[80 : len(before)] == before[80:]
    assert_exact(path, tiny_lm, caps)
    listing = invoke("archive", "list", path)
    assert listing.exit_code == 0 and "s6" in listing.stdout and "segment" in listing.stdout
    with Archive(path, model=tiny_lm) as arc:
        s6 = next(e for e in arc.sessions if e["id"] == "s6")
        tail = arc.trie.nodes[s6["trie"]["node"]]
    assert tail.n_tokens == len(" And a follow-up question.")  # s6 only paid its extension


def test_add_refuses_duplicates_flat_files_and_other_models(caps, tiny_lm, tmp_path):
    path = tmp_path / "a.skv"
    compress_captures(caps[:2], path, codec="seq", model=tiny_lm)
    before = path.read_bytes()
    result = invoke("archive", "add", path, caps[0], "--model", tiny_lm.folder)
    assert result.exit_code == 2 and "already has a session 's0'" in result.stderr
    assert "Traceback" not in result.output and path.read_bytes() == before
    compress_captures(caps[:1], tmp_path / "f.skv", codec="seq", model=tiny_lm, layout="flat")
    result = invoke("archive", "add", tmp_path / "f.skv", caps[1], "--model", tiny_lm.folder)
    assert result.exit_code == 2 and "archive compact" in result.stderr
    result = invoke("archive", "add", tmp_path / "missing.skv", caps[1])
    assert result.exit_code == 2 and "no such archive" in result.stderr


def test_extract_decodes_only_the_sessions_path(caps, tiny_lm, tmp_path, monkeypatch):
    from seqkv_cli.trie.node_source import NodeSource

    path = tmp_path / "t.skv"
    compress_captures(caps, path, codec="seq", model=tiny_lm)
    asked: list[int] = []
    original = NodeSource.payload
    monkeypatch.setattr(NodeSource, "payload", lambda self, n: asked.append(n) or original(self, n))
    result = invoke(
        "archive", "extract", path, "s1", "-o", tmp_path / "s1.st", "--model", tiny_lm.folder
    )
    assert result.exit_code == 0, result.output
    with Archive(path) as arc:
        expected = chain(arc.trie.nodes, arc.session("s1")["trie"]["node"])
    assert sorted(asked) == expected and len(expected) < len(arc.trie.nodes)  # only its path
    assert same_capture(load_capture(caps[1]), load_capture(tmp_path / "s1.st"))


def test_compact_folds_segments_and_converts_flat_files(caps, tiny_lm, tmp_path):
    path = tmp_path / "a.skv"
    compress_captures(caps[:1], path, codec="seq", model=tiny_lm)
    for p in caps[1:]:
        assert invoke("archive", "add", path, p, "--model", tiny_lm.folder).exit_code == 0
    grown = path.stat().st_size
    result = invoke("archive", "compact", path, "--model", tiny_lm.folder)
    assert result.exit_code == 0, result.output
    assert path.stat().st_size < grown
    with Archive(path) as arc:
        assert arc.trie.segments == [1] and [e["id"] for e in arc.sessions] == [
            load_capture(p).session_id for p in caps
        ]
    assert_exact(path, tiny_lm, caps)
    flat = tmp_path / "flat.skv"
    compress_captures(caps, flat, codec="seq-fast", model=tiny_lm, layout="flat")
    assert invoke("archive", "compact", flat, "--model", tiny_lm.folder).exit_code == 0
    with Archive(flat) as arc:
        assert arc.trie is not None
    assert_exact(flat, tiny_lm, caps)


def test_trie_tables_cost_under_16_bytes_per_branching_session(tiny_lm, tmp_path):
    from seqkv_cli.trie.encode import SegmentBuild, session_records
    from seqkv_cli.trie.plan import Trie
    from seqkv_cli.trie.segment import place_sessions
    from seqkv_cli.trie.sources import Source
    from seqkv_cli.trie.tables import Node, encode_tables

    rng = np.random.default_rng(0)
    prefix = rng.integers(0, 250, 2000)
    meta = {"dtype": "bf16", "num_layers": 2, "num_kv_heads": 2, "head_dim": 16}
    sources = []
    for i in range(100):
        tokens = np.concatenate([prefix, rng.integers(0, 250, 200)])
        sources.append(Source(f"chat-{i:03d}", {**meta, "session_id": f"chat-{i:03d}"}, tokens))
    trie = Trie()
    ends = place_sessions(trie, sources)
    build = SegmentBuild(session_records(sources, ends))
    for node in trie.nodes:  # payload lengths as a 200-token branch would have
        build.tables.nodes.append(Node(node.parent, node.attach, len(node.tokens), 90, 0))
    size = len(encode_tables(build.tables, 0))
    assert size / 100 <= 16, size


def test_resume_continues_exactly_like_the_original_cache(caps, tiny_lm, tmp_path):
    from seqkv_cli.archive import continue_from

    path = tmp_path / "t.skv"
    compress_captures(caps, path, codec="seq", model=tiny_lm)
    original = load_capture(caps[3])
    with Archive(path, model=tiny_lm) as arc:
        restored = arc.restore(arc.session("s3"))
    want = continue_from(tiny_lm, original, " Then", 24)
    got = continue_from(tiny_lm, restored, " Then", 24)
    assert got == want and len(got) == 24
    result = invoke(
        "resume",
        path,
        "s3",
        "--prompt",
        " Then",
        "--max-new-tokens",
        "24",
        "--model",
        tiny_lm.folder,
    )
    assert result.exit_code == 0, result.output
    assert result.stdout.rstrip("\n") == tiny_lm.tokenizer.decode(want)


def _add_process(path, capture_path, model_folder):
    code = "from seqkv_cli.cli import main; main()"
    args = [sys.executable, "-c", code, "archive", "add", str(path), str(capture_path)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen(
        [*args, "--model", str(model_folder)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )


def test_kill_during_add_loses_nothing_and_the_file_opens(caps, tiny_lm, tmp_path):
    path = tmp_path / "a.skv"
    compress_captures(caps[:3], path, codec="seq", model=tiny_lm)
    rng = np.random.default_rng(1)
    committed = list(caps[:3])
    for p in caps[3:]:
        proc = _add_process(path, p, tiny_lm.folder)
        time.sleep(float(rng.uniform(0.3, 3.5)))  # imports, model load, encode or commit
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        with Archive(path, model=tiny_lm) as arc:
            ids = [e["id"] for e in arc.sessions]
        want = [load_capture(c).session_id for c in committed]
        assert ids in (want, [*want, load_capture(p).session_id])
        if len(ids) == len(want):  # killed before its commit: add it again, unkilled
            assert invoke("archive", "add", path, p, "--model", tiny_lm.folder).exit_code == 0
        committed.append(p)
        assert_exact(path, tiny_lm, committed)


def test_concurrent_adds_are_serialised(caps, tiny_lm, tmp_path):
    path = tmp_path / "a.skv"
    compress_captures(caps[:3], path, codec="seq", model=tiny_lm)
    procs = [_add_process(path, p, tiny_lm.folder) for p in caps[3:5]]
    outputs = [proc.communicate(timeout=300) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outputs
    assert_exact(path, tiny_lm, caps[:5])
    with Archive(path) as arc:
        assert arc.trie.segments == [1, 2, 3]


def test_damaged_trie_tables_fail_cleanly():
    from seqkv_cli.errors import SeqkvError
    from seqkv_cli.trie.tables import Node as TableNode
    from seqkv_cli.trie.tables import SegmentTables, SessionRecord, decode_tables, encode_tables

    tables = SegmentTables(
        [TableNode(-1, 0, 300, 120, 7), TableNode(0, 250, 40, 20, 9)],
        [SessionRecord("a", 0, 300, 2100), SessionRecord("b", 1, 40, 2400, 0, {"src": "x"})],
        [{"dtype": "bf16", "shapes": {}}],
    )
    data = encode_tables(tables, 0)
    back = decode_tables(data, 0, "t")
    assert [(n.parent, n.attach, n.n_tokens) for n in back.nodes] == [(-1, 0, 300), (0, 250, 40)]
    assert [(s.id, s.end_node, s.extra) for s in back.sessions] == [
        ("a", 0, {}),
        ("b", 1, {"src": "x"}),
    ]
    rng = np.random.default_rng(0)
    for _ in range(400):
        bad = bytearray(data)
        for i in rng.integers(0, len(bad), int(rng.integers(1, 4))):
            bad[i] ^= int(rng.integers(1, 256))
        cut = bytes(bad[: int(rng.integers(0, len(bad) + 1))]) if rng.random() < 0.3 else bytes(bad)
        with contextlib.suppress(SeqkvError):
            decode_tables(cut, 0, "t")


@pytest.mark.parametrize("codec", ["raw", "turbo3"])
def test_per_vector_trie_stores_prefix_kv_once(caps, tmp_path, codec):
    trie = compress_captures(caps, tmp_path / "t.skv", codec=codec)
    flat = compress_captures(caps, tmp_path / "f.skv", codec=codec, layout="flat")
    assert trie.file_bytes * 2.5 < flat.file_bytes
    path = tmp_path / "a.skv"
    compress_captures(caps[:3], path, codec=codec)
    for p in caps[3:]:
        assert invoke("archive", "add", path, p).exit_code == 0
    for archive in (tmp_path / "t.skv", path):
        with Archive(archive) as arc:
            got = {e["id"]: r for e, r in arc.restore_many(arc.sessions)}
        for p in caps:
            cap = load_capture(p)
            restored = got[cap.session_id]
            assert torch.equal(restored.tokens, cap.tokens)
            assert torch.equal(restored.surprisal, cap.surprisal.double())
            if codec == "raw":
                assert same_capture(cap, restored)
            else:  # turbo3's own bound: relative L2 error of a 3-bit quantizer
                for a, b in zip(cap.keys, restored.keys, strict=True):
                    err = (a.float() - b.float()).norm() / a.float().norm()
                    assert float(err) < 0.3


def test_per_vector_trie_keeps_a_non_canonical_sessions_own_bits(tiny_lm, tmp_path):
    """Ordinary (non-canonical) captures of a shared prefix may differ in the last bits:
    a lossless codec must then store the difference for the session that differs."""
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "a.txt").write_text(PREFIX + "short one")
    (folder / "b.txt").write_text(PREFIX + "a much longer second question " * 4)
    results = capture(
        sorted(str(p) for p in folder.glob("*.txt")),
        model=tiny_lm,
        out=tmp_path / "caps",
        canonical=False,
    )
    paths = [r.path for r in results]
    compress_captures(paths, tmp_path / "t.skv", codec="raw")
    with Archive(tmp_path / "t.skv") as arc:
        got = {e["id"]: r for e, r in arc.restore_many(arc.sessions)}
    for p in paths:
        cap = load_capture(p)
        assert same_capture(cap, got[cap.session_id])


def test_near_duplicate_members_are_stored_as_edits(tiny_lm, tmp_path):
    folder = tmp_path / "docs"
    folder.mkdir()
    body = "Always answer in short sentences, cite the manual, never guess a rating. " * 4
    texts = {
        "c0": "You are a helpful assistant. " + body + "Q: pump?",
        "c1": "You are a helpful assistant. " + body + "Q: pipe?",
        "m0": "You are an AI assistant. " + body + "Q: tank?",
    }
    for name, text in texts.items():
        (folder / f"{name}.txt").write_text(text)
    paths = [
        r.path
        for r in capture(sorted(map(str, folder.glob("*.txt"))), model=tiny_lm, out=folder / "caps")
    ]
    plain = compress_captures(paths, tmp_path / "p.skv", codec="seq", model=tiny_lm)
    near = compress_captures(paths, tmp_path / "n.skv", codec="seq", model=tiny_lm, near_dup=True)
    assert near.part_bytes["tokens"] < 0.75 * plain.part_bytes["tokens"]
    with Archive(tmp_path / "n.skv", model=tiny_lm) as arc:
        m0 = arc.session("m0")
        assert (
            m0["trie"]["centroid"] is not None
            and m0["positions"] == load_capture(paths[2]).positions
        )
        [(entry, restored)] = list(arc.restore_many([m0]))  # the centroid is decoded, not yielded
    assert entry["id"] == "m0" and same_capture(load_capture(paths[2]), restored)
    assert_exact(tmp_path / "n.skv", tiny_lm, paths)
    result = invoke("compress", *paths, "-o", tmp_path / "x.skv", "--codec", "turbo3", "--near-dup")
    assert result.exit_code == 2 and "--near-dup needs" in result.stderr


def test_a_session_inside_a_node_decodes_only_its_own_tokens(caps, tiny_lm, tmp_path, monkeypatch):
    from seqkv_cli.sequential.adapter import CanonicalLogits

    path = tmp_path / "a.skv"
    compress_captures([caps[6]], path, codec="seq", model=tiny_lm)  # s6 = s3 + a follow-up
    assert invoke("archive", "add", path, caps[3], "--model", tiny_lm.folder).exit_code == 0
    with Archive(path) as arc:
        s3 = arc.session("s3")
        assert s3["trie"]["node"] == 0 and s3["trie"]["end"] < arc.trie.nodes[0].n_tokens
    steps = []
    one, many = CanonicalLogits.feed_rows, CanonicalLogits.feed_drafts
    monkeypatch.setattr(  # tokens fed, one per row or several with guesses (test_drafts.py)
        CanonicalLogits, "feed_rows", lambda self, t, ids: steps.append(1) or one(self, t, ids)
    )
    monkeypatch.setattr(
        CanonicalLogits, "feed_drafts", lambda self, t, ids: steps.append(1) or many(self, t, ids)
    )
    with Archive(path, model=tiny_lm) as arc:
        restored = arc.restore(arc.session("s3"))
        fed = arc.decode_stats.tokens
    assert same_capture(load_capture(caps[3]), restored)
    assert fed == restored.positions  # not one token into s6's follow-up
    assert len(steps) <= restored.positions
