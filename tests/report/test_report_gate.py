"""CI gates (exit 0 / 1, failing sessions named) and bad input (exit 2, one line, no files)."""

from __future__ import annotations

import json

import pytest

from cli_run import error_lines, invoke


def test_gate_passes_and_fails_naming_sessions(caps, tiny_model_dir, tmp_path):
    seq = ("--codecs", "seq", "--model", tiny_model_dir)
    ok = invoke("report", *caps, *seq, "--max-gap", "100", "--require-exact")
    assert ok.exit_code == 0, ok.output
    assert "gate passed (2 row(s) checked)" in ok.stdout

    out = tmp_path / "gate.json"
    bad = invoke("report", *caps, *seq, "--max-bits-per-position", "1", "--json", out)
    assert bad.exit_code == 1, bad.output
    [line] = error_lines(bad)
    assert "gate failed for 2 row(s)" in line and "a (seq)" in line and "b (seq)" in line
    assert "bits/position" in line and "> 1" in line
    doc = json.loads(out.read_text())  # outputs are written before the gate decides
    assert doc["gate"]["passed"] is False
    assert {f["id"] for f in doc["gate"]["failures"]} == {"a", "b"}


def test_require_exact_fails_lossy_rows_and_gates_only_rows_under_test(caps, tiny_model_dir):
    lossy = invoke("report", caps[0], "--codecs", "turbo3", "--require-exact")
    assert lossy.exit_code == 1
    [line] = error_lines(lossy)
    assert "a (turbo3): not bit-exact" in line
    # A .skv input is under test; default baselines (lossy int8, turbo3) are not gated.
    seq = ("--codecs", "seq", "--model", tiny_model_dir, "--no-verify")
    unverified = invoke("report", caps[0], *seq, "--require-exact")
    assert unverified.exit_code == 1 and "exactness not verified" in error_lines(unverified)[0]


def test_gate_on_skv_input_ignores_default_baselines(caps, tiny_model_dir, tmp_path):
    skv = tmp_path / "seq.skv"
    made = invoke("compress", caps[0], "-o", skv, "--codec", "seq", "--model", tiny_model_dir)
    assert made.exit_code == 0, made.output
    gates = ("--require-exact", "--max-gap", "50")
    result = invoke("report", caps[0], skv, "--model", tiny_model_dir, *gates)
    assert result.exit_code == 0, result.output
    assert "seq [seq.skv]" in result.stdout and "turbo3" in result.stdout
    assert "gate passed (1 row(s) checked)" in result.stdout


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--codecs", "seq,zip9"], "unknown codec id 'zip9'; available: "),
        (["--codecs", " , "], "--codecs is empty"),
        (["--max-gap", "-1"], "--max-gap must be a finite number > 0, got -1.0"),
        (["--max-gap", "0"], "--max-gap must be a finite number > 0"),
        (["--max-bits-per-position", "nan"], "--max-bits-per-position must be a finite number"),
        (["--max-bits-per-position", "inf"], "--max-bits-per-position must be a finite number"),
        (["--window", "0"], "--window >= 1"),
        (["--continuation", "-3"], "--continuation must be >= 0"),
        (["--plots", "{blocker}/plots"], "cannot create output directory"),
        (["--json", "{tmp}"], "is a directory; give a file name"),
    ],
)
def test_bad_options_one_line_exit_2_no_files(caps, tmp_path, args, fragment):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    args = [a.format(blocker=blocker, tmp=tmp_path) for a in args]
    out = tmp_path / "out"
    result = invoke("report", *caps, *args, "--csv", out / "r.csv", "--markdown", out / "r.md")
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines == error_lines(result) and len(lines) == 1, result.stderr
    assert fragment in lines[0], lines[0]
    assert "Traceback" not in result.output
    assert not list(out.glob("*")) if out.exists() else True
    if "zip9" in fragment:
        assert "seq, seq-fast" in lines[0] and "turbo3" in lines[0] and "hf-quanto4" in lines[0]


def test_bad_inputs_one_line_exit_2(caps, tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "fake.skv").write_text("not a container")
    for target, fragment in (
        (tmp_path / "missing.safetensors", "no such input"),
        (tmp_path / "empty", "holds no capture"),
        (tmp_path / "notes.txt", "neither a capture"),
        (tmp_path / "fake.skv", "fake.skv"),
    ):
        result = invoke("report", caps[0], target, "--json", tmp_path / "r.json")
        assert result.exit_code == 2, result.output
        [line] = error_lines(result)
        assert fragment in line and "Traceback" not in result.output
        assert not (tmp_path / "r.json").exists()


def test_a_failed_write_leaves_no_output_behind(caps, tmp_path, monkeypatch):
    import pandas as pd

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pd.DataFrame, "to_parquet", disk_full)
    out = tmp_path / "out"
    result = invoke(
        "report",
        caps[0],
        "--codecs",
        "int8",
        "--json",
        out / "r.json",
        "--csv",
        out / "r.csv",
        "--parquet",
        out / "r.parquet",
        "--plots",
        out / "plots",
    )
    assert result.exit_code == 2, result.output
    [line] = error_lines(result)
    assert "cannot write" in line and "r.parquet" in line and "No space left" in line
    assert sorted(p.name for p in out.rglob("*")) == ["plots"]  # the folder, no file
