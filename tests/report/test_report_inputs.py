"""Inputs of `seqkv report`: .skv files, mixed models, the optional quanto baseline; the
marginal-cost model and the continuation probe on their own."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from cli_run import error_lines, invoke
from conftest import build_tiny_model
from seqkv_cli import capture, load_capture
from seqkv_cli.report.continuation import Continuation
from seqkv_cli.report.windows import cost_curve, mean_curve, windows


def test_mixed_models_are_grouped_and_said_so(caps, tiny_model_dir, tmp_path):
    other = build_tiny_model(tmp_path / "other", seed=1)
    text = tmp_path / "c.txt"
    text.write_text("A second model reads this sentence. " * 2)
    [res] = capture([str(text)], model=str(other), out=tmp_path / "caps")
    out = tmp_path / "r.json"
    plots = tmp_path / "plots"
    models = ("--model", tiny_model_dir, "--model", other)  # each serves its own captures
    result = invoke(
        "report", *caps, res.path, "--codecs", "seq,int8", *models, "--json", out, "--plots", plots
    )
    assert result.exit_code == 0, result.output
    names = sorted(p.name for p in plots.iterdir())
    assert len(names) == 6 and all(n.endswith(".png") for n in names)
    assert sum("-tiny-llama-" in n for n in names) == sum("-other-" in n for n in names) == 3
    assert "inputs come from 2 models" in result.stderr and "rows are grouped" in result.stderr
    doc = json.loads(out.read_text())
    assert len(doc["models"]) == 2 and doc["notes"][0].startswith("inputs come from 2 models")
    fingerprints = {r["id"]: r["model_fingerprint"] for r in doc["sessions"]}
    assert fingerprints["c"] != fingerprints["a"] == fingerprints["b"]
    assert {(r["id"], r["codec"]) for r in doc["sessions"] if r["id"] == "c"} == {
        ("c", "seq"),
        ("c", "int8"),
    }
    assert all(r["exact"] is True for r in doc["sessions"] if r["codec"] == "seq")


def test_skv_without_capture_reports_sizes_and_no_fidelity(caps, tmp_path):
    skv = tmp_path / "k.skv"
    assert invoke("compress", *caps, "-o", skv, "--codec", "kivi4").exit_code == 0
    out = tmp_path / "r.json"
    result = invoke("report", skv, "--json", out)
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())["sessions"]
    assert [(r["id"], r["codec"], r["role"]) for r in rows] == [
        ("a", "kivi4", "subject"),
        ("b", "kivi4", "subject"),
    ]
    assert all(r["exact"] is None and r["max_abs_error"] is None for r in rows)
    assert all(r["log2_ppl"] > 0 and r["bits_per_position"] > 0 for r in rows)


def test_session_codec_without_its_model(caps, tmp_path, monkeypatch):
    """Named explicitly, seq without a loadable model is an error; by default, a note."""
    from seqkv_cli.kvcapture.capture_file import load_capture_meta, save_capture

    # a capture names its model by name and fingerprint, never by a folder of this machine
    meta = load_capture_meta(caps[0])
    assert "model_source" not in meta and meta["model_name"] == "tiny-llama"
    result = invoke("report", caps[0], "--codecs", "seq")
    assert result.exit_code == 2
    assert "cannot compute seq: no model is known for it (pass --model)" in result.stderr
    # a capture of an older seqkv names the folder it was made from, here one since deleted
    cap = load_capture(caps[0])
    cap.meta["model_source"] = str(tmp_path / "gone")  # the model folder has been deleted
    save_capture(cap, tmp_path / "a.safetensors")
    assert load_capture_meta(tmp_path / "a.safetensors")["model_source"].endswith("gone")
    result = invoke("report", tmp_path / "a.safetensors", "--codecs", "seq")
    assert result.exit_code == 2 and "cannot compute seq" in error_lines(result)[0]
    result = invoke("report", tmp_path / "a.safetensors", "--codecs", "int8")
    assert result.exit_code == 0, result.output
    monkeypatch.setattr("seqkv_cli.report.collect.DEFAULT_CODECS", ("seq", "int8"))
    result = invoke("report", tmp_path / "a.safetensors")
    assert result.exit_code == 0 and "cannot compute seq" in result.stderr


def test_quanto_baseline_is_optional(caps, tmp_path):
    from seqkv_cli.report.quanto import quanto_available

    out = tmp_path / "q.json"
    result = invoke("report", caps[0], "--codecs", "hf-quanto4,int8", "--json", out)
    assert result.exit_code == 0, result.output
    rows = {r["codec"]: r for r in json.loads(out.read_text())["sessions"]}
    if not quanto_available():
        assert "hf-quanto4 skipped: optimum-quanto is not installed" in result.stderr
        assert set(rows) == {"int8"}
        alone = invoke("report", caps[0], "--codecs", "hf-quanto4")
        assert alone.exit_code == 2 and "nothing to report" in error_lines(alone)[0]
        pytest.skip("optimum-quanto not installed: only the note was checked")
    q = rows["hf-quanto4"]
    comps = q["components_per_position"]
    assert q["exact"] is False and 0 < q["attention_error"] < 0.2
    assert 4 * comps <= q["bits_per_position"] <= 8 * comps  # 4-bit codes + group scales


def test_cost_curve_sums_to_total_and_follows_surprisal():
    surprisal = np.array([1.0, 3.0, 0.5, 4.5])
    parts = {"tokens": 20.0, "header": 10.0, "kv": 0.0}
    seq = cost_curve(True, 5, parts, surprisal, first_token_bits=1.0)
    assert seq.sum() == pytest.approx(30.0)
    shape = np.array([1.0, 1.0, 3.0, 0.5, 4.5])
    assert seq == pytest.approx(shape * 2 + 2)  # 20 bits over a shape summing to 10, + 10/5
    flat = cost_curve(False, 5, parts, surprisal)
    assert flat == pytest.approx(np.full(5, 6.0))
    w = windows(seq, surprisal, 2)
    assert [(x["start"], x["end"]) for x in w] == [(0, 2), (2, 4), (4, 5)]
    assert [x["surprisal"] for x in w] == [1.0, 1.75, 4.5]
    assert mean_curve([np.array([1.0, 2.0]), np.array([3.0])]) == pytest.approx([2.0, 2.0])


def test_continuation_of_an_identical_cache_agrees_fully(caps, tiny_lm):
    cap = load_capture(caps[1])
    probe = Continuation(tiny_lm, cap, 5)
    same = probe.measure(cap)
    assert same.delta_log2_ppl == 0.0 and same.greedy_agreement == 1.0
    assert same.greedy_prefix == 5 and len(probe.greedy) == 5
    noisy = load_capture(caps[1])
    gen = torch.Generator().manual_seed(0)
    noisy.keys = [k + 3 * torch.randn(k.shape, generator=gen).to(k.dtype) for k in noisy.keys]
    hurt = probe.measure(noisy)
    assert hurt.delta_log2_ppl != 0.0 and hurt.ppl_ratio == pytest.approx(2**hurt.delta_log2_ppl)
