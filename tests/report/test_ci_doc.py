"""The CI job in docs/CI.md, run end to end: capture -> compress -> report -> gate.

The `seqkv` lines are taken from the document itself (so it cannot drift from what works) and
run on the tiny random model instead of the embedded one, so the test takes seconds.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
from pathlib import Path

import pytest

from cli_run import error_lines, invoke

ROOT = Path(__file__).resolve().parents[2]
CI_DOC, SAMPLE_DATA = ROOT / "docs" / "CI.md", ROOT / "sample_data"


def ci_commands() -> list[list[str]]:
    """The `seqkv ...` commands of the YAML block, continuation lines joined."""
    block = re.search(r"```yaml\n(.*?)```", CI_DOC.read_text(), re.S).group(1)
    commands, current = [], ""
    for line in block.splitlines():
        text = line.strip()
        if current or text.startswith("seqkv "):
            current += " " + text.rstrip("\\").strip()
            if not text.endswith("\\"):
                commands.append(shlex.split(current)[1:])  # without "seqkv"
                current = ""
    return commands


def with_option(args: list[str], option: str, value: str) -> list[str]:
    i = args.index(option)
    return [*args[: i + 1], value, *args[i + 2 :]]


@pytest.fixture
def job_dir(tmp_path, monkeypatch):
    (tmp_path / "sample_data").mkdir()
    shutil.copy(SAMPLE_DATA / "prose.txt", tmp_path / "sample_data" / "prose.txt")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_ci_job_passes_then_fails_when_thresholds_tighten(job_dir, tiny_model_dir):
    commands = ci_commands()
    assert [c[0] for c in commands] == ["capture", "compress", "report"]
    for args in commands:
        result = invoke(*args, "--model", tiny_model_dir)
        assert result.exit_code == 0, (args, result.output)
    report = commands[-1]
    assert "gate passed (1 row(s) checked)" in result.stdout
    run = job_dir / "run"
    for name in ("report.json", "report.csv", "report.md"):
        assert (run / name).stat().st_size > 0
    assert len(list((run / "plots").glob("*.png"))) == 3
    doc = json.loads((run / "report.json").read_text())
    assert doc["gate"]["passed"] is True
    subject = [r for r in doc["sessions"] if r["role"] == "subject"]
    assert [(r["id"], r["codec"], r["exact"]) for r in subject] == [("prose", "seq", True)]
    assert {r["codec"] for r in doc["sessions"]} >= {"seq", "seq-fast", "int8", "turbo3"}

    for option, value, reason in (
        ("--max-gap", "1.0", "gap "),
        ("--max-bits-per-position", "2", "bits/position "),
    ):
        tight = with_option(report, option, value)
        result = invoke(*tight, "--model", tiny_model_dir)
        assert result.exit_code == 1, result.output
        [line] = error_lines(result)
        assert line.startswith("error: gate failed for 1 row(s): prose (seq): ")
        assert reason in line
        assert "failed" in (run / "report.md").read_text()
