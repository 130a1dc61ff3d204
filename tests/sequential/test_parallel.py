"""`seq --parallel N`: a session's tokens as N runs that restore side by side, exactly."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from cli_run import assert_error, invoke
from passes import counted
from seqkv_cli import load_capture
from seqkv_cli.archive import Archive, compress_captures, same_capture
from seqkv_cli.errors import SeqkvError
from seqkv_cli.kvcapture.api import capture
from seqkv_cli.runtime.numerics import PORTABLE
from seqkv_codecs.errors import CorruptStreamError
from seqkv_codecs.sequential.parallel_stream import (
    MAX_CHUNKS,
    chunk_bounds,
    pack_parallel,
    parse_parallel,
)
from seqkv_codecs.sequential.token_coder import assemble_token_stream

GOLDEN = Path(__file__).resolve().parent.parent / "golden"


@pytest.fixture(scope="module")
def captures(tiny_lm, tmp_path_factory):
    folder = tmp_path_factory.mktemp("parallel")
    (folder / "a.txt").write_text("Lighthouses guided ships along dangerous coasts. " * 3)
    (folder / "b.txt").write_text("def f(x):\n    return x * 2\n" * 3)
    return [
        r.path
        for r in capture([str(folder / "a.txt"), str(folder / "b.txt")], model=tiny_lm, out=folder)
    ]


def test_chunk_bounds_cover_the_session_in_balanced_runs():
    for n in range(0, 40):
        for k in range(1, 12):
            bounds = chunk_bounds(n, k)
            assert len(bounds) == max(1, min(k, n))
            assert bounds[0][0] == 0 and bounds[-1][1] == n
            assert all(b[1] == c[0] for b, c in itertools.pairwise(bounds))
            sizes = [b - a for a, b in bounds]
            assert sizes == sorted(sizes, reverse=True) and max(sizes) - min(sizes) <= 1


def pack_v1(streams: list[bytes]) -> bytes:
    """SKPS version 1 framing (still read): magic, 1, 0, k, k x u32 lengths, the streams."""
    head = b"SKPS" + bytes([1, 0]) + len(streams).to_bytes(2, "little")
    return head + b"".join(len(s).to_bytes(4, "little") for s in streams) + b"".join(streams)


def fake_runs(n: int, k: int, chunk: int = 2, vocab: int = 300) -> list[bytes]:
    """Token streams of the runs of an n-token session (payloads are arbitrary bytes:
    the framing never reads them)."""
    runs = []
    for j, (a, b) in enumerate(chunk_bounds(n, k)):
        parts = [(bytes([j + 1]) * (1 + c % 3), 1000 * j + c) for c in range(a, b, chunk)]
        runs.append(assemble_token_stream(24, vocab, b - a, chunk, parts))
    return runs


def test_run_framing_round_trips_and_refuses_every_inconsistency():
    streams = fake_runs(11, 3)  # runs of 4, 4 and 3 tokens: 2, 2 and 2 chunks
    data = pack_parallel(streams)
    assert data[4] == 2 and parse_parallel(data) == streams  # the v1 streams, byte for byte
    assert len(data) < len(pack_v1(streams)) - 3 * 20  # one header instead of one per run
    assert parse_parallel(pack_v1(streams)) == streams  # version 1 is still read
    for cut in range(len(data)):  # every truncation
        with pytest.raises(CorruptStreamError):
            parse_parallel(data[:cut])
    with pytest.raises(CorruptStreamError, match="do not match"):
        parse_parallel(data + b"x")
    header_end = 20 + 6 * (1 + 4) + 4  # shared fields, 6 chunks (varint + CRC), header CRC
    for i in range(4, header_end):  # any flipped bit of the header, its table or its CRC
        bad = bytearray(data)
        bad[i] ^= 0x10
        with pytest.raises(CorruptStreamError):
            parse_parallel(bytes(bad))
    hostile = {
        "magic": b"SKPX" + data[4:],
        "version": data[:4] + b"\x03" + data[5:],
        "no runs": data[:6] + b"\x00\x00" + data[8:],
        "too many runs": data[:6] + (MAX_CHUNKS + 1).to_bytes(2, "little") + data[8:],
        "v1 reserved": pack_v1(streams)[:5] + b"\x01" + pack_v1(streams)[6:],
        "v1 empty run": pack_v1([streams[0], b"", streams[1]]),
        "v1 lengths past the end": pack_v1(streams)[:8] + (999).to_bytes(4, "little"),
    }
    for name, bad in hostile.items():
        with pytest.raises(CorruptStreamError):
            parse_parallel(bad)
        assert name
    with pytest.raises(CorruptStreamError, match="version 3 is not supported"):
        parse_parallel(hostile["version"])
    with pytest.raises(ValueError):
        pack_parallel([])
    with pytest.raises(ValueError, match="not the runs of one session"):
        pack_parallel([streams[2], streams[0], streams[1]])  # 3, 4, 4 tokens
    with pytest.raises(ValueError, match="different settings"):
        pack_parallel([fake_runs(4, 2)[0], fake_runs(4, 2, vocab=301)[1]])


def test_shared_framing_rejects_more_runs_than_tokens():
    import struct
    import zlib

    head = b"SKPS" + bytes([2, 24]) + (3).to_bytes(2, "little") + struct.pack("<III", 300, 2, 2)
    data = head + zlib.crc32(head).to_bytes(4, "little")  # 3 runs of a 2-token session
    with pytest.raises(CorruptStreamError, match="header is invalid"):
        parse_parallel(data)


def test_runs_restore_bit_for_bit_in_fewer_passes(
    captures, tiny_lm, tiny_model_dir, tmp_path, monkeypatch
):
    lengths = [load_capture(c).positions for c in captures]
    plain, runs4 = tmp_path / "plain.skv", tmp_path / "p4.skv"
    assert (
        invoke(
            "compress", *captures, "-o", plain, "--layout", "flat", "--model", tiny_model_dir
        ).exit_code
        == 0
    )
    result = invoke(
        "compress", *captures, "-o", runs4, "--parallel", "4", "--model", tiny_model_dir
    )
    assert result.exit_code == 0, result.output
    assert "flat layout" in result.stdout  # auto: runs are coded per session
    with Archive(runs4) as arc:
        assert arc.codec.get_config()["parallel"] == 4 and arc.trie is None
    with Archive(plain) as arc:
        assert "parallel" not in arc.codec.get_config()  # files without runs are unchanged
    passes = counted(monkeypatch)
    with Archive(runs4, model=tiny_lm) as arc:
        restored = {e["id"]: r for e, r in arc.restore_many(arc.sessions)}
    # every run of both sessions is a row of the same passes: the longest run's length - 1
    # (a run's first token is coded uniformly, with no pass), where one run takes n - 1
    longest = max(chunk_bounds(n, 4)[0][1] for n in lengths)
    assert len(passes) == longest - 1 and passes[0] == 8
    for c in captures:
        cap = load_capture(c)
        assert same_capture(cap, restored[cap.session_id])
    # the decompress CLI restores the same bytes
    assert (
        invoke("decompress", runs4, "-o", tmp_path / "out", "--model", tiny_model_dir).exit_code
        == 0
    )
    for c in captures:
        cap = load_capture(c)
        assert same_capture(cap, load_capture(tmp_path / "out" / f"{cap.session_id}.safetensors"))
    # the runs cost bits: each loses the context before it
    sizes = {}
    for path in (plain, runs4):
        with Archive(path) as arc:
            sizes[path.name] = sum(
                s.length for s in arc.reader.sections if s.name.endswith("tokens.seq")
            )
    assert sizes["p4.skv"] > sizes["plain.skv"]


def test_restore_time_estimate_counts_runs(captures, tiny_lm, tiny_model_dir, tmp_path):
    path = tmp_path / "p3.skv"
    compress_captures(
        captures, path, codec={"id": "seq", "parallel": 3, "numerics": PORTABLE}, model=tiny_lm
    )
    lengths = [load_capture(c).positions for c in captures]
    result = invoke("info", path, "--restore-time", "--model", tiny_model_dir)
    assert result.exit_code == 0, result.output
    longest = max(chunk_bounds(n, 3)[0][1] for n in lengths)
    assert f"{longest:,} passes" in result.stdout and "3 runs a session" in result.stdout


def test_parallel_refusals(captures, tiny_lm, tiny_model_dir, tmp_path):
    model = tiny_model_dir
    out = tmp_path / "x.skv"
    cases = [
        (("--parallel", "2", "--codec", "int8"), "--parallel applies to seq, not int8"),
        (("--parallel", "0"), "--parallel must be in 1..256, got 0"),
        (("--parallel", "257"), "--parallel must be in 1..256, got 257"),
        (("--parallel", "2", "--layout", "trie"), "--parallel runs code each session on its own"),
        (
            ("--parallel", "2", "--layout", "compact"),
            "--parallel runs code each session on its own",
        ),
    ]
    for args, fragment in cases:
        assert_error(invoke("compress", captures[0], "-o", out, *args, "--model", model), fragment)
        assert not out.exists()
    with pytest.raises(SeqkvError, match="whole number"):
        compress_captures(captures, out, codec={"id": "seq", "parallel": 2.5}, model=tiny_lm)


def test_forged_runs_fail_their_session_alone(captures, tiny_lm, tmp_path):
    """Valid checksums, hostile runs: unbalanced run lengths, a plain stream under a
    parallel codec, a run of another vocabulary: one line each, the other session restores."""
    from forge import put_together, take_apart

    path = tmp_path / "p2.skv"
    compress_captures(
        captures, path, codec={"id": "seq", "parallel": 2, "numerics": PORTABLE}, model=tiny_lm
    )
    header, sections = take_apart(path)
    name = next(n for n in sections if n.endswith("tokens.seq"))
    runs = parse_parallel(sections[name])
    plain = tmp_path / "plain.skv"
    compress_captures(
        captures[:1], plain, codec={"id": "seq", "numerics": PORTABLE}, model=tiny_lm, layout="flat"
    )
    _, plain_sections = take_apart(plain)
    plain_stream = next(v for n, v in plain_sections.items() if n.endswith("tokens.seq"))
    forged = {
        # version 1 framing (still read) can hold any runs: the restore checks them
        "runs swapped": (pack_v1(runs[::-1]), "token runs hold"),
        "no runs": (plain_stream, "not in runs"),
        "a third run": (pack_v1([*runs, runs[-1]]), "token stream holds"),
    }
    for what, (data, fragment) in forged.items():
        bad = tmp_path / f"{what}.skv"
        bad.write_bytes(put_together(header, {**sections, name: data}))
        with Archive(bad, model=tiny_lm) as arc:
            got = {e["id"]: r for e, r in arc.restore_many(arc.sessions)}
        first = arc.sessions[0]["id"]
        assert isinstance(got[first], SeqkvError) and fragment in str(got[first]), (
            what,
            got[first],
        )
        other = next(k for k in got if k != first)
        cap = next(load_capture(c) for c in captures if load_capture(c).session_id == other)
        assert same_capture(cap, got[other]), what


@pytest.mark.parametrize("version", [1, 2])
def test_golden_parallel_files_restore_their_captures(version):
    import hashlib

    from forge import take_apart

    folder = GOLDEN / f"parallel-v{version}"
    expected = json.loads((folder / "expected.json").read_text())
    golden = folder / "seq-parallel3.skv"
    assert hashlib.sha256(golden.read_bytes()).hexdigest() == expected["sha256"]
    _, sections = take_apart(golden)
    streams = [v for n, v in sections.items() if n.endswith("tokens.seq")]
    assert len(streams) == 2 and all(s[:5] == b"SKPS" + bytes([version]) for s in streams)
    with Archive(golden, model=str(GOLDEN / "seq-v1" / "model")) as arc:
        assert arc.codec.get_config()["parallel"] == 3
        restored = {e["id"]: arc.restore(e) for e in arc.sessions}
    assert sorted(restored) == ["a", "b"]
    for sid, cap in restored.items():
        original = load_capture(GOLDEN / "seq-portable-v1" / "captures" / f"{sid}.safetensors")
        assert same_capture(cap, original)


def test_archive_commands_say_runs_keep_the_flat_layout(captures, tiny_model_dir, tmp_path):
    path = tmp_path / "p2.skv"
    made = invoke("compress", captures[0], "-o", path, "--parallel", "2", "--model", tiny_model_dir)
    assert made.exit_code == 0, made.output
    before = path.read_bytes()
    result = invoke("archive", "add", path, captures[1], "--model", tiny_model_dir)
    assert_error(result, "codes each session as runs (seq --parallel)")
    result = invoke("archive", "compact", path, "--model", tiny_model_dir)
    assert_error(result, "seq --parallel 2 (runs coded per session) keeps the flat layout")
    assert path.read_bytes() == before
