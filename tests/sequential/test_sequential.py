"""seq and seq-fast: tokens coded, K/V recomputed, restored bit for bit."""

from __future__ import annotations

import pytest

from cli_run import invoke
from conftest import SAMPLE_DATA, build_tiny_model
from seqkv_cli import capture, load_capture
from seqkv_cli.archive import Archive, compress_captures, decompress, same_capture
from seqkv_cli.errors import SeqkvError


@pytest.fixture(scope="module")
def caps(tiny_lm, tmp_path_factory):
    folder = tmp_path_factory.mktemp("seqcaps")
    (folder / "a.txt").write_text("Water flows from reservoirs through mains to every tap. " * 6)
    (folder / "b.txt").write_text("for i in range(10):\n    print(i * i)\n" * 8)
    canonical = capture(
        [str(folder / "a.txt"), str(folder / "b.txt")], model=tiny_lm, out=folder / "canon"
    )
    ordinary = capture(
        [str(folder / "a.txt")], model=tiny_lm, out=folder / "plain", canonical=False
    )
    return [r.path for r in canonical], ordinary[0].path


@pytest.mark.parametrize("codec", ["seq", "seq-fast"])
def test_canonical_capture_restores_exactly_with_empty_residual(caps, tiny_lm, tmp_path, codec):
    paths, _ = caps
    res = compress_captures(paths, tmp_path / "x.skv", codec=codec, model=tiny_lm)
    assert "residual" not in res.part_bytes and res.part_bytes["tokens"] > 0
    with Archive(tmp_path / "x.skv", model=tiny_lm) as arc:
        assert all(e["residual_bytes"] == 0 for e in arc.sessions)
        for entry, path in zip(arc.sessions, paths, strict=True):
            assert same_capture(load_capture(path), arc.restore(entry))
    out = decompress(tmp_path / "x.skv", tmp_path / "dec", model=tiny_lm)
    for original, restored in zip(paths, out, strict=True):
        assert same_capture(load_capture(original), load_capture(restored))
    # the K/V itself is not stored: the file is tiny next to the captured K/V
    assert res.file_bytes < res.input_kv_bytes / 50


def test_seq_costs_about_the_surprisal(caps, tiny_lm, tmp_path):
    paths, _ = caps
    compress_captures(paths[:1], tmp_path / "x.skv", codec="seq", model=tiny_lm, layout="flat")
    cap = load_capture(paths[0])
    with Archive(tmp_path / "x.skv", model=tiny_lm) as arc:
        entry = arc.sessions[0]
        token_bytes = arc.reader.sections[0].length
    ideal = float(cap.surprisal.sum()) + 8.0  # + first token, uniform over 258 symbols
    assert abs(entry["token_bits_ideal"] - ideal) < 0.01 * ideal
    assert token_bytes * 8 <= entry["token_bits_ideal"] + 8 * 40  # header + chunk table


@pytest.mark.parametrize("layout", ["trie", "flat"])
def test_non_canonical_capture_needs_and_gets_a_lossless_residual(caps, tiny_lm, tmp_path, layout):
    _, plain = caps
    res = compress_captures([plain], tmp_path / "x.skv", codec="seq", model=tiny_lm, layout=layout)
    assert res.part_bytes.get("residual", 0) > 0
    [restored] = decompress(tmp_path / "x.skv", tmp_path / "dec", model=tiny_lm)
    original = load_capture(plain)
    assert same_capture(original, load_capture(restored))
    with Archive(tmp_path / "x.skv", model=tiny_lm) as arc:  # modelled on the rounding
        parts = [s.name for s in arc.reader.sections if "residual." in s.name]
        assert b"SKR2" in {arc.reader.read_section(p)[:4] for p in parts}
        # its own surprisal, against the recompute's: well under the 8 raw bytes a value
        [name] = [s.name for s in arc.reader.sections if s.name.endswith("/surprisal")]
        part = arc.reader.read_section(name)
        assert part[:4] == b"SKS1" and len(part) < 6 * len(original.surprisal)
    with pytest.raises(SeqkvError, match="do not reproduce its own K/V"):
        compress_captures(
            [plain], tmp_path / "y.skv", codec={"id": "seq", "residual": "none"}, model=tiny_lm
        )
    assert not (tmp_path / "y.skv").exists()


def test_wrong_model_is_refused_naming_both_fingerprints(caps, tiny_lm, tmp_path):
    paths, _ = caps
    compress_captures(paths[:1], tmp_path / "x.skv", codec="seq", model=tiny_lm)
    other = build_tiny_model(tmp_path / "other", seed=7)
    result = invoke("decompress", tmp_path / "x.skv", "-o", tmp_path / "dec", "--model", other)
    assert result.exit_code == 2
    assert "fingerprint " + tiny_lm.fingerprint[:16] in result.stderr
    assert "Traceback" not in result.output
    assert not (tmp_path / "dec").exists() or not list((tmp_path / "dec").iterdir())
    result = invoke(
        "compress", paths[0], "-o", tmp_path / "y.skv", "--codec", "seq", "--model", other
    )
    assert result.exit_code == 2 and "different model" in result.stderr


def test_corrupt_token_chunk_is_named_and_other_sessions_decode(caps, tiny_lm, tmp_path):
    from seqkv_cli.container import open_container, write_container

    paths, _ = caps
    compress_captures(paths, tmp_path / "x.skv", codec="seq", model=tiny_lm, layout="flat")
    with open_container(tmp_path / "x.skv") as reader:
        header = reader.header
        sections = {e.name: bytearray(reader.read_section(e.name)) for e in reader.sections}
    sections["s0/tokens.seq"][-3] ^= 0x40  # damage the payload; the container CRC is rewritten
    write_container(tmp_path / "bad.skv", header, [(k, bytes(v)) for k, v in sections.items()])
    result = invoke(
        "decompress", tmp_path / "bad.skv", "-o", tmp_path / "d1", "--model", tiny_lm.folder
    )
    assert result.exit_code == 2 and "token chunk 0" in result.stderr, result.stderr
    result = invoke(
        "decompress",
        tmp_path / "bad.skv",
        "-o",
        tmp_path / "d2",
        "--model",
        tiny_lm.folder,
        "--session",
        "b",
    )
    assert result.exit_code == 0, result.output
    assert same_capture(load_capture(paths[1]), load_capture(tmp_path / "d2" / "b.safetensors"))


# slow (300 model steps, ~115 s): the default run holds the embedded model's seq to the same
# properties in test_skv_cli.py::test_seq_round_trips_embedded_model_captures_through_the_cli
# (exact round trip), report/test_report_values.py::test_embedded_model_seq_costs_its_surprisal
# (exact, token bits within 2% of the surprisal) and, for stepping past a key block,
# test_canonical.py::test_embedded_model_bit_identical_prefill_chunked_stepwise.
@pytest.mark.model
@pytest.mark.slow
def test_embedded_model_seq_round_trip_is_exact_and_near_log2_ppl(embedded_lm, tmp_path):
    [res] = capture(
        [str(SAMPLE_DATA / "prose.txt")], model=embedded_lm, out=tmp_path, max_tokens=300
    )
    out = compress_captures(
        [res.path], tmp_path / "p.skv", codec="seq", model=embedded_lm, check=False, layout="flat"
    )
    assert "residual" not in out.part_bytes
    with Archive(tmp_path / "p.skv", model=embedded_lm) as arc:
        restored = arc.restore(arc.sessions[0])
        token_bits = arc.reader.sections[0].length * 8
    assert same_capture(res.capture, restored)
    n = res.capture.positions
    bound = 1.02 * float(res.capture.surprisal.sum()) + 15.6  # first token: log2 49152
    assert token_bits <= bound + 8 * 40, (token_bits / n, res.capture.log2_ppl)


def test_tolerance_mode_bounds_the_error_and_is_checked(caps, tiny_lm, tmp_path):
    _, plain = caps
    exact = compress_captures([plain], tmp_path / "e.skv", codec="seq", model=tiny_lm)
    eps = 1e-2  # about a bf16 step of the tiny model's K/V: most differences are within it
    res = compress_captures(
        [plain], tmp_path / "t.skv", codec={"id": "seq", "tolerance": eps}, model=tiny_lm
    )
    assert res.part_bytes.get("residual", 0) < exact.part_bytes["residual"]
    [restored] = decompress(tmp_path / "t.skv", tmp_path / "dec", model=tiny_lm)
    a, b = load_capture(plain), load_capture(restored)
    for x, y in zip(a.keys + a.values, b.keys + b.values, strict=True):
        assert float((x.double() - y.double()).abs().max()) <= eps


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--tolerance", "0"], "--tolerance must be > 0"),
        (["--tolerance", "-1"], "--tolerance must be > 0"),
        (["--tolerance", "0.1", "--codec", "int8"], "--tolerance applies to seq"),
    ],
)
def test_bad_tolerance_is_refused(caps, tmp_path, args, fragment):
    paths, _ = caps
    result = invoke("compress", paths[0], "-o", tmp_path / "x.skv", "--codec", "seq", *args)
    assert result.exit_code == 2 and fragment in result.stderr, result.output
    assert not (tmp_path / "x.skv").exists()
