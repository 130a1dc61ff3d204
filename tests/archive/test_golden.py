"""Golden .skv files written by an earlier version must decode to the recorded bytes forever."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from seqkv_cli import load_capture
from seqkv_cli.archive import Archive

GOLDEN = Path(__file__).resolve().parent.parent / "golden" / "v1"
EXPECTED = json.loads((GOLDEN / "expected.json").read_text())


@pytest.mark.parametrize("codec", sorted(EXPECTED))
def test_golden_file_decodes_to_recorded_bytes(codec):
    from golden.make_golden import digest

    with Archive(GOLDEN / f"{codec}.skv") as arc:
        arc.reader.verify()
        assert arc.codec.codec_id == codec
        restored = arc.restore(arc.sessions[0])
    assert digest(restored) == EXPECTED[codec]
    original = load_capture(GOLDEN / "capture.safetensors")
    assert torch.equal(restored.tokens, original.tokens)
    if arc.codec.lossless:
        assert digest(original) == EXPECTED[codec]


SEQ_GOLDEN = Path(__file__).resolve().parent.parent / "golden" / "seq-v1"
SEQ_FILES = json.loads((SEQ_GOLDEN / "expected.json").read_text())


# The machine class that wrote seq-v1/: the legacy forward's bits depend on ATen's and MKL's
# kernels (an AVX-512 machine computes other bits), so the decode runs in a child process that
# imitates it, as any user of an old file must (docs/NUMERICS.md, "legacy files").
LEGACY_WRITER = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    "SEQKV_BENCH_THREADS": "2",
}


@pytest.mark.parametrize("name", sorted(SEQ_FILES))
def test_legacy_numerics_seq_golden_restores_its_captures_bit_for_bit(name):
    """`seq`/`seq-fast` files written before numeric paths were named (legacy fp32 forward)."""

    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("the legacy golden files need a CPU with AVX2 to imitate their writer")
    from bench.studies.portability import capture_digest, decode_in_child

    with Archive(SEQ_GOLDEN / f"{name}.skv") as arc:
        assert arc.codec.codec_id == SEQ_FILES[name]["codec"]
        assert arc.codec.numerics == "canonical-fp32-rb8-kb256-v1"
    model = str(SEQ_GOLDEN / "model")
    try:
        got, _ = decode_in_child(SEQ_GOLDEN / f"{name}.skv", model, LEGACY_WRITER, timeout=300)
    except RuntimeError as exc:
        # Some machines cannot imitate the writer at all (seen at stop 20: an Intel Xeon whose
        # MKL AVX2 kernels split rows by batch size). There a decoder must refuse in its one
        # line, before any token is decoded; any other failure (a CRC mismatch) is a defect.
        refusal = "this machine's BLAS is not row-invariant; the canonical-fp32-rb8-kb256-v1"
        assert refusal in str(exc), exc
        pytest.skip("this machine cannot imitate the legacy golden files' writer (refused)")
    want = {
        sid: capture_digest(load_capture(SEQ_GOLDEN / "captures" / f"{sid}.safetensors"))
        for sid in ("a", "b")
    }
    assert got == want


PORTABLE_GOLDEN = SEQ_GOLDEN.parent / "seq-portable-v1"


@pytest.mark.parametrize("version", ["v1", "v2", "v3"])
@pytest.mark.parametrize("name", sorted(SEQ_FILES))
def test_portable_numerics_seq_golden_restores_its_captures_bit_for_bit(name, version):
    """Files of portable-fx53-v1, -v2 and -v3 (same tiny model as seq-v1): no definition drifts."""
    from seqkv_cli.archive import same_capture

    golden = SEQ_GOLDEN.parent / f"seq-portable-{version}"
    with Archive(golden / f"{name}.skv", model=str(SEQ_GOLDEN / "model")) as arc:
        assert arc.codec.numerics == f"portable-fx53-{version}"
        restored = {e["id"]: arc.restore(e) for e in arc.sessions}
    assert sorted(restored) == ["a", "b"]
    for sid, cap in restored.items():
        original = load_capture(golden / "captures" / f"{sid}.safetensors")
        assert original.meta["numeric_path"] == f"portable-fx53-{version}"
        assert same_capture(cap, original)


# (folder, the seq-portable golden its session comes from, format minor)
COMPACT_GOLDENS = [("compact-v1", "seq-portable-v1", 2), ("compact-v3", "seq-portable-v3", 5)]
COMPACT_CASES = [
    (folder, source, minor, codec)
    for folder, source, minor in COMPACT_GOLDENS
    for codec in ("seq", "seq-fast")
]


@pytest.mark.parametrize(("folder", "source", "minor", "codec"), COMPACT_CASES)
def test_compact_golden_restores_its_capture_and_is_written_the_same_today(
    folder, source, minor, codec, tmp_path
):
    """Compact files (format 1.2 on v1, 1.5 on v3): they decode forever, and today's writer
    gives the same bytes."""
    import hashlib

    from seqkv_cli.archive import compress_captures, same_capture

    golden_dir = SEQ_GOLDEN.parent / folder
    expected = json.loads((golden_dir / "expected.json").read_text())
    golden = golden_dir / f"{codec}.skv"
    assert hashlib.sha256(golden.read_bytes()).hexdigest() == expected[codec]["sha256"]
    with Archive(golden, model=str(SEQ_GOLDEN / "model")) as arc:
        assert arc.reader.version == (1, minor) and arc.codec.codec_id == codec
        [entry] = arc.sessions
        restored = arc.restore(entry)
    capture = SEQ_GOLDEN.parent / source / "captures" / "a.safetensors"
    assert entry["id"] == "a" and same_capture(restored, load_capture(capture))
    again = tmp_path / "again.skv"
    compress_captures([capture], again, codec=codec, model=str(SEQ_GOLDEN / "model"))
    assert again.read_bytes() == golden.read_bytes()


RESIDUAL_GOLDEN = SEQ_GOLDEN.parent


@pytest.mark.parametrize("name", ["seq-trie", "seq-flat"])
@pytest.mark.parametrize(("folder", "version"), [("residual-skr2-v1", 1), ("residual-skr2-v2", 2)])
def test_rounding_residual_golden_restores_a_foreign_capture_bit_for_bit(folder, version, name):
    """SKR2 parts (a non-canonical capture's residual, modelled on the recompute's rounding):
    stream version 1 (seqkv 0.2, on numeric path v1) and version 2 (seqkv 0.3, v2)."""
    from seqkv_cli.archive import same_capture

    golden = RESIDUAL_GOLDEN / folder
    with Archive(golden / f"{name}.skv", model=str(SEQ_GOLDEN / "model")) as arc:
        parts = [s.name for s in arc.reader.sections if "residual." in s.name]
        heads = {arc.reader.read_section(p)[:5] for p in parts}
        assert parts and heads == {b"SKR2" + bytes([version])}
        [entry] = arc.sessions
        restored = arc.restore(entry)
    original = load_capture(golden / "captures" / "a.safetensors")
    assert original.meta["numeric_path"] != "portable-fx53-v1"  # a foreign cache
    assert same_capture(restored, original)


TABLES_GOLDEN = SEQ_GOLDEN.parent / "tables-v1"
TABLES_FILES = json.loads((TABLES_GOLDEN / "expected.json").read_text())


@pytest.mark.parametrize("name", sorted(TABLES_FILES))
def test_binary_table_golden_restores_every_session_bit_for_bit(name):
    """Format 1.4 (binary section tables, seqkv 0.4): a foreign capture with its residual
    parts and its own surprisal (`SKS1`), in a trie, a flat file and a trie grown by one
    append (two binary records; the appended session is canonical)."""
    from seqkv_cli.archive import same_capture

    captures = {
        "a": RESIDUAL_GOLDEN / "residual-skr2-v2" / "captures" / "a.safetensors",
        "b": SEQ_GOLDEN.parent / "seq-portable-v2" / "captures" / "b.safetensors",
    }
    want = TABLES_FILES[name]
    path = TABLES_GOLDEN / f"{name}.skv"
    assert path.stat().st_size == want["bytes"]
    with Archive(path, model=str(SEQ_GOLDEN / "model")) as arc:
        assert arc.reader.version == (1, 4) and arc.reader.tables
        assert arc.reader.generation == len(want["sessions"])
        assert any("residual." in s.name for s in arc.reader.sections)
        assert [e["id"] for e in arc.sessions] == want["sessions"]
        surprisal = [s.name for s in arc.reader.sections if s.name.endswith("/surprisal")]
        assert [arc.reader.read_section(p)[:4] for p in surprisal] == [b"SKS1"]  # only "a"
        for entry in arc.sessions:
            restored = arc.restore(entry)
            assert same_capture(restored, load_capture(captures[entry["id"]])), entry["id"]


RECORDS_GOLDEN = SEQ_GOLDEN.parent / "records-v1"
RECORDS_FILES = json.loads((RECORDS_GOLDEN / "expected.json").read_text())


@pytest.mark.parametrize("name", sorted(RECORDS_FILES))
def test_binary_record_golden_restores_every_session_bit_for_bit(name):
    """Format 1.6 (binary records after the first, trie tables version 2, seqkv 0.6): a trie
    grown by `archive add`, and an agent's three turns kept through the library API (later
    segments inherit their profile; creation times as seconds after the one before)."""
    from seqkv_cli.archive import same_capture

    want = RECORDS_FILES[name]
    path = RECORDS_GOLDEN / f"{name}.skv"
    assert path.stat().st_size == want["bytes"]
    captures = SEQ_GOLDEN.parent / "seq-portable-v3" / "captures"
    with Archive(path, model=str(SEQ_GOLDEN / "model")) as arc:
        assert arc.reader.version == (1, 6) and arc.reader.generation == len(want["sessions"])
        indexes = [arc.reader.read_section(f"t{k}/index") for k in (1, 2)]
        assert all(raw[0] & 0xE0 == 0x20 for raw in indexes)  # trie tables version 2
        assert [e["id"] for e in arc.sessions] == want["sessions"]
        restored = {e["id"]: arc.restore(e) for e in arc.sessions}
    if name == "seq-appended":
        for sid, cap in restored.items():
            assert same_capture(cap, load_capture(captures / f"{sid}.safetensors")), sid
        return
    tokens = load_capture(captures / "b.safetensors").tokens
    created = [arc_entry["capture_meta"].get("created") for arc_entry in arc.sessions]
    assert created[1:] == ["2026-11-30T00:53:34Z", "2026-11-30T00:53:41Z"]
    for sid, cut in zip(want["sessions"], want["tokens"], strict=True):
        assert restored[sid].tokens.tolist() == tokens[:cut].tolist(), sid


LOAD_MODES_GOLDEN = SEQ_GOLDEN.parent / "load-modes-v1"
LOAD_MODES_FILES = json.loads((LOAD_MODES_GOLDEN / "expected.json").read_text())


@pytest.mark.parametrize("name", sorted(LOAD_MODES_FILES))
def test_load_modes_golden_restores_every_session_bit_for_bit(name):
    """Format 1.7 (seqkv 0.7): an agent's turns with a load mode each — a `seq` archive whose
    second and fourth segments name `seq-fast`, and an archive opened fast — both with packed
    ids. Every session is the same tokens and K/V as the 1.6 golden's of the same tokens."""
    want = LOAD_MODES_FILES[name]
    path = LOAD_MODES_GOLDEN / f"{name}.skv"
    assert path.stat().st_size == want["bytes"]
    model = str(SEQ_GOLDEN / "model")
    with Archive(path, model=model) as arc:
        assert arc.reader.version == (1, 7)
        named = {2: "seq-fast", 4: "seq-fast"} if name == "mixed-turns" else {}
        assert arc.trie.codecs == named
        assert arc.codec.codec_id == ("seq" if name == "mixed-turns" else "seq-fast")
        assert [e["id"] for e in arc.sessions] == want["sessions"]
        restored = {e["id"]: arc.restore(e) for e in arc.sessions}
    tokens = load_capture(SEQ_GOLDEN.parent / "seq-portable-v3" / "captures" / "b.safetensors")
    for sid, cut in zip(want["sessions"], want["tokens"], strict=True):
        assert restored[sid].tokens.tolist() == tokens.tokens[:cut].tolist(), sid
    with Archive(RECORDS_GOLDEN / "api-turns.skv", model=model) as old:
        whole = old.restore(old.session("agent/turn-3"))  # all of b's tokens, format 1.6
    last = restored[want["sessions"][-1]]
    assert whole.tokens.tolist() == last.tokens.tolist()
    for a, b in zip(whole.keys + whole.values, last.keys + last.values, strict=True):
        assert torch.equal(a, b)


COMPACT_ARCHIVE_GOLDEN = SEQ_GOLDEN.parent / "compact-archive-v1"
COMPACT_ARCHIVE_FILES = json.loads((COMPACT_ARCHIVE_GOLDEN / "expected.json").read_text())


@pytest.mark.parametrize("name", sorted(COMPACT_ARCHIVE_FILES))
def test_compact_archive_golden_restores_every_session_bit_for_bit(name, tmp_path):
    """Format 1.8 (seqkv 0.8): compact archives. Two captures with `--layout compact` (and
    today's writer gives the same bytes); an agent's four turns compacted, small and fast,
    whose turns end inside one node: each restores the tokens and K/V the 1.6 golden's of the
    same tokens restore."""
    import hashlib

    from seqkv_cli.archive import compress_captures, same_capture

    want = COMPACT_ARCHIVE_FILES[name]
    path = COMPACT_ARCHIVE_GOLDEN / f"{name}.skv"
    assert hashlib.sha256(path.read_bytes()).hexdigest() == want["sha256"]
    model = str(SEQ_GOLDEN / "model")
    captures = SEQ_GOLDEN.parent / "seq-portable-v3" / "captures"
    with Archive(path, model=model) as arc:
        assert arc.reader.version == (1, 8) and arc.reader.archive
        assert [e["id"] for e in arc.sessions] == want["sessions"]
        restored = {e["id"]: arc.restore(e) for e in arc.sessions}
    if name == "captures":
        for sid in want["sessions"]:
            assert same_capture(restored[sid], load_capture(captures / f"{sid}.safetensors"))
        again = tmp_path / "again.skv"
        paths = [captures / f"{sid}.safetensors" for sid in want["sessions"]]
        compress_captures(paths, again, codec="seq", model=model, layout="compact")
        assert again.read_bytes() == path.read_bytes()
        return
    tokens = load_capture(captures / "b.safetensors").tokens
    for sid, cut in zip(want["sessions"], want["tokens"], strict=True):
        assert restored[sid].tokens.tolist() == tokens[:cut].tolist(), sid
    with Archive(RECORDS_GOLDEN / "api-turns.skv", model=model) as old:
        whole = old.restore(old.session("agent/turn-3"))  # all of b's tokens, format 1.6
    last = restored[want["sessions"][-1]]
    for a, b in zip(whole.keys + whole.values, last.keys + last.values, strict=True):
        assert torch.equal(a, b)
    first = restored[want["sessions"][0]]  # a turn that ends inside the node: its rows
    for a, b in zip(whole.keys + whole.values, first.keys + first.values, strict=True):
        assert torch.equal(a[:, : want["tokens"][0]], b)  # (heads, positions, dim)


REPLAY_GOLDEN = SEQ_GOLDEN.parent / "replay-v1"
REPLAY_FILES = json.loads((REPLAY_GOLDEN / "expected.json").read_text())


@pytest.mark.parametrize("name", sorted(REPLAY_FILES))
def test_replay_golden_gives_every_record_back(name):
    """Format 1.9: replay records in binary (an agent's three turns with their own cache; the
    first alone, a one-session compact archive; the turns compacted, whose shorter turns name
    the longest and drop its last calls). Each record reads back whole, and the tokens are
    b's; on the machine that wrote them, each replay reproduces its digest."""
    import transformers

    from seqkv_cli.archive import entry_record, reproduced

    want = REPLAY_FILES[name]
    path = REPLAY_GOLDEN / f"{name}.skv"
    assert path.stat().st_size == want["bytes"]
    model = SEQ_GOLDEN / "model"
    with Archive(path, model=str(model)) as arc:
        assert list(arc.reader.version) == want["version"] == [1, 9]
        assert getattr(arc.reader, "archive", False) == (name != "replay-turns")
        records = {e["id"]: entry_record(e) for e in arc.sessions}
        restored = {e["id"]: arc.restore(e) for e in arc.sessions}
    assert records == want["records"]
    calls = [[20, 1], [1, 4], [10, 1], [1, 3], [8, 1], [1, 2]]
    tokens = load_capture(SEQ_GOLDEN.parent / "seq-portable-v3" / "captures" / "b.safetensors")
    for k, (sid, rec) in enumerate(sorted(records.items()), 1):
        assert rec["calls"] == calls[: 2 * k] and len(rec["sha256"]) == 32
        n = sum(a * b for a, b in rec["calls"])
        assert restored[sid].tokens.tolist() == tokens.tokens[:n].tolist()
    if name == "replay-turns":  # turn 3's record: continues turn 2, prefill 8, 2 steps
        with Archive(path) as arc:
            table = arc.reader.read_section("t3/index")
        assert table[0] & 0xC0 == 0xC0
        digest = bytes.fromhex(records["agent/turn-3"]["sha256"])
        assert bytes([0x19, 8, 2]) + digest in table
    rec = records["agent/turn-1"]
    if (rec["torch"], rec["transformers"]) == (torch.__version__, transformers.__version__):
        user = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        ids = restored["agent/turn-1"].tokens.tolist()
        assert reproduced(user.eval(), ids, rec) is not None
