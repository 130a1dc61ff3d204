"""Every hostile file in tests/attacks/ is refused by the CLI in one line, exit 2, no traceback.

The files are crafted (make_attacks.py) with valid CRCs; expected.json holds each one's
attack and the refusal it must get.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from seqkv_cli.cli import app

HERE = Path(__file__).resolve().parent
EXPECTED = json.loads((HERE / "expected.json").read_text())


def test_corpus_matches_expected():
    assert sorted(p.name for p in HERE.glob("*.skv")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_attack_is_refused_in_one_line(name, tmp_path):
    start = time.perf_counter()
    result = CliRunner().invoke(
        app, ["decompress", str(HERE / name), "-o", str(tmp_path / "out")], env={"COLUMNS": "400"}
    )
    assert time.perf_counter() - start < 30, "took too long"  # the first one imports torch
    assert result.exit_code == 2, result.output
    assert ("Traceback" not in result.output and result.exception is None) or isinstance(
        result.exception, SystemExit
    ), result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], result.stderr
    assert EXPECTED[name]["refusal"] in errors[0], errors[0]
