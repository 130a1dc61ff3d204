"""Issue 16: the verification and pipeline-summary maths behind `seqkv verify` and
`seqkv pipeline`, as library functions returning plain values (`archive/verify.py`,
`report/pipeline_summary.py`)."""

from __future__ import annotations

import dataclasses
import math
import re
from types import SimpleNamespace

import pytest
import torch

from seqkv_cli.archive import (
    SessionCheck,
    check_session,
    check_sessions,
    check_verify_mode,
    sessions_to_decode,
)
from seqkv_cli.errors import SeqkvError
from seqkv_cli.kvcapture.capture_file import Capture, load_capture
from seqkv_cli.report.pipeline_summary import (
    FILE_ROW,
    file_log2_ppl,
    fp16_bits_per_position,
    summarise,
)
from test_data_safety import invoke, synthetic, write

LOSSLESS = SimpleNamespace(codec_id="raw", lossless=True)
LOSSY = SimpleNamespace(codec_id="int8", lossless=False)
BOUNDED = SimpleNamespace(codec_id="seq", lossless=False, tolerance=0.25)


def shifted(cap: Capture, layer: int, by: float) -> Capture:
    """A copy with one key element of `layer` moved by `by` (fp32: exactly representable)."""
    keys = [k.clone() for k in cap.keys]
    keys[layer][0, 0, 0] += by
    return dataclasses.replace(cap, keys=keys)


# -- one session ------------------------------------------------------------------------------


def test_an_exact_copy_checks_clean_with_zero_errors():
    cap = synthetic("a", dtype=torch.float32)
    check = check_session(cap, dataclasses.replace(cap), LOSSLESS)
    assert check == SessionCheck("a", True, (), check.errors, 0.0)
    assert check.ok and check.exact and check.max_abs == 0.0 and check.rel_l2 == 0.0
    assert [(e.kind, e.layer) for e in check.errors] == [
        ("key", 0),
        ("key", 1),
        ("value", 0),
        ("value", 1),
    ]


def test_one_shifted_element_is_measured_in_its_layer_and_judged_by_the_codec():
    cap = synthetic("a", dtype=torch.float32)
    bad = shifted(cap, 1, 0.5)
    check = check_session(cap, bad, LOSSLESS)
    assert check.problems == ("not bit-exact (max abs error 0.5)",)
    assert not check.ok and not check.exact
    assert [e.exact for e in check.errors] == [True, False, True, True]
    assert check.errors[1].max_abs == 0.5 and check.max_abs == 0.5
    assert check.rel_l2 == pytest.approx(0.5 / float(cap.keys[1].norm()), rel=1e-6)
    assert check.attention_error > 0.0
    # a per-vector lossy codec promises no bound: measured, not judged
    lossy = check_session(cap, bad, LOSSY)
    assert lossy.ok and lossy.max_abs == 0.5 and lossy.errors == check.errors
    # a codec with a tolerance judges the error against it
    assert check_session(cap, bad, BOUNDED).problems == (
        "max abs error 0.5 above the tolerance 0.25",
    )
    assert check_session(cap, shifted(cap, 1, 0.125), BOUNDED).ok


def test_other_tokens_give_problems_but_no_errors_and_measure_false_skips_them():
    cap = synthetic("a", dtype=torch.float32)
    tokens = cap.tokens.clone()
    tokens[2] += 1
    check = check_session(cap, dataclasses.replace(cap, tokens=tokens), LOSSY)
    assert check.problems == ("tokens differ (first at position 2)",)
    assert check.errors is None and check.attention_error is None and not check.exact
    assert check.max_abs is None and check.rel_l2 is None
    quick = check_session(cap, shifted(cap, 0, 0.5), LOSSLESS, measure=False)
    assert quick.problems == ("not bit-exact (max abs error 0.5)",) and quick.errors is None


# -- which sessions a --verify mode decodes ----------------------------------------------------


def test_sessions_to_decode_takes_all_or_the_two_shortest_by_length():
    entries = [{"id": "c", "positions": 30}, {"id": "a", "positions": 10}]
    entries.append({"id": "b", "positions": 20})
    assert [e["id"] for e in sessions_to_decode(entries, "all")] == ["a", "b", "c"]
    assert [e["id"] for e in sessions_to_decode(entries, "sample")] == ["a", "b"]
    assert sessions_to_decode(entries, "none") == []
    assert check_verify_mode("sample") == "sample"
    with pytest.raises(SeqkvError, match="--verify must be one of all, sample, none, not 'x'"):
        sessions_to_decode(entries, "x")


# -- every session of an archive ----------------------------------------------------------------


def test_check_sessions_decodes_an_archive_in_order_and_compares_what_it_is_given(tmp_path):
    from seqkv_cli.archive import Archive

    paths = [write(tmp_path, sid, sid, dtype=torch.float32) for sid in ("a", "b", "c")]
    skv = tmp_path / "x.skv"
    assert invoke("compress", *paths, "-o", skv, "--codec", "raw").exit_code == 0
    a, b = load_capture(paths[0]), load_capture(paths[1])
    with Archive(skv) as arc:
        checks = check_sessions(arc, {"a": a, "b": shifted(b, 0, 0.5)})
        assert [c.session_id for c in checks] == ["a", "b", "c"]
        assert checks[0].ok and checks[0].exact and checks[0].max_abs == 0.0
        assert checks[1].problems == ("not bit-exact (max abs error 0.5)",)
        assert checks[1].errors[0].max_abs == 0.5 and not checks[1].errors[0].exact
        assert checks[2] == SessionCheck("c", compared=False) and checks[2].ok
        only_c = check_sessions(arc, {}, [e for e in arc.sessions if e["id"] == "c"])
        assert only_c == [SessionCheck("c", compared=False)]
        with pytest.raises(SeqkvError, match=re.escape("holds no session 'zz' to compare with")):
            check_sessions(arc, {"zz": a})


# -- the pipeline summary -----------------------------------------------------------------------


def _capture(sid: str, bits: list[float]) -> Capture:
    n = len(bits) + 1  # the first position has no surprisal
    return Capture(
        torch.arange(n), [], [], torch.tensor(bits, dtype=torch.float64), {"session_id": sid}
    )


def test_fp16_bits_and_the_file_log2_pp():
    assert fp16_bits_per_position(30, 3, 64) == 30 * 3 * 64 * 2 * 16 == 184_320
    caps = [_capture("a", [2.0] * 9), _capture("b", [4.0] * 5)]
    assert file_log2_ppl(caps, 16) == pytest.approx(38 / 14)
    assert file_log2_ppl([], 0) == 0.0


def test_summarise_gives_bits_ratios_and_exactness_per_session_and_for_the_file():
    caps = [_capture("a", [2.0] * 9), _capture("b", [4.0] * 5)]
    entries = [{"residual_bytes": 0}, {"residual_bytes": 12}]
    accounts = [{"bits_per_position": 40.0}, {"bits_per_position": 64.0}]
    seq = SimpleNamespace(positions=16, file_bytes=100, input_kv_bytes=65_536)
    base = SimpleNamespace(positions=16, file_bytes=450, part_bytes={"kv": 400})
    out = summarise(caps, entries, accounts, seq, base, 2048, {"a": True})
    a, b = out.sessions
    assert (a.session, a.tokens, a.log2_ppl, a.seq_bits) == ("a", 10, 2.0, 40.0)
    assert (a.baseline_bits, a.fp16_bits, a.vs_fp16) == (200.0, 2048, 51.2)
    assert (a.residual_bytes, a.exact) == (0, True)
    assert (b.tokens, b.log2_ppl, b.vs_fp16, b.residual_bytes, b.exact) == (6, 4.0, 32.0, 12, None)
    f = out.file
    assert (f.session, f.tokens, f.seq_bits, f.baseline_bits) == (FILE_ROW, 16, 50.0, 200.0)
    assert f.vs_fp16 == pytest.approx(40.96) and f.log2_ppl == pytest.approx(38 / 14)
    assert (f.residual_bytes, f.exact) == (None, None)
    sizes = (out.seq_file_bytes, out.baseline_file_bytes, out.captured_kv_bytes)
    assert sizes == (100, 450, 65_536)
    with pytest.raises(ValueError):  # captures and the container's sessions must pair up
        summarise(caps[:1], entries, accounts, seq, base, 2048, {})


def test_the_pipeline_table_prints_the_summary_numbers(tiny_model_dir, tmp_path):
    """A pipeline run on the tiny model: the file row is the container's own arithmetic."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "one.txt").write_text("the quick brown fox jumps over the lazy dog")
    (docs / "two.txt").write_text("pack my box with five dozen liquor jugs, twice over")
    run = tmp_path / "run"
    args = ("pipeline", docs, "-o", run, "--model", tiny_model_dir, "--baseline", "int8")
    result = invoke(*args, "--verify", "all")
    assert result.exit_code == 0, result.output
    caps = [load_capture(run / "captures" / f"{s}.safetensors") for s in ("one", "two")]
    positions = sum(c.positions for c in caps)
    seq_bytes = (run / "seq.skv").stat().st_size
    lines = {line.split("│")[1].strip(): line for line in result.stdout.splitlines() if "│" in line}
    cells = [c.strip() for c in lines["all (file)"].split("│")[1:-1]]
    log2_ppl = sum(float(c.surprisal.sum()) for c in caps) / (positions - 2)
    assert cells[1] == f"{positions:,}" and cells[2] == f"{log2_ppl:.3f}"
    assert cells[3] == f"{seq_bytes * 8 / positions:.3f}"
    assert cells[6] == f"{2 * 2 * 16 * 2 * 16:,}"  # the tiny model: 2 layers, 2 KV heads, 16
    for sid, cap in zip(("one", "two"), caps, strict=True):
        row = [c.strip() for c in lines[sid].split("│")[1:-1]]
        assert row[1] == str(cap.positions) and row[2] == f"{cap.log2_ppl:.3f}"
        assert row[-1] == "yes"
    assert not math.isnan(log2_ppl)
