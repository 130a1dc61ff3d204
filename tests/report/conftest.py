"""Captures of the tiny random model, and one full report run shared by the value tests."""

from __future__ import annotations

import json

import pytest

from cli_run import invoke
from seqkv_cli import capture

TEXTS = {
    "a": "Lighthouses guided ships along dangerous coasts for centuries. " * 2,
    "b": "def f(x):\n    return x * 2\n" * 4,
}


@pytest.fixture(scope="package")
def caps(tiny_lm, tmp_path_factory):
    """Two canonical bf16 captures (126 and 108 positions) with no common prefix."""
    folder = tmp_path_factory.mktemp("report-caps")
    inputs = []
    for name, text in TEXTS.items():
        (folder / f"{name}.txt").write_text(text)
        inputs.append(str(folder / f"{name}.txt"))
    results = capture(inputs, model=tiny_lm, out=folder / "caps")
    return [r.path for r in results]


@pytest.fixture(scope="package")
def full(caps, tiny_model_dir, tmp_path_factory):
    """`seqkv report` with every output, on raw / seq / turbo3 with continuation metrics."""
    out = tmp_path_factory.mktemp("report-out")
    result = invoke(
        "report",
        caps[0].parent,
        "--model",  # a capture names no folder of the machine it was made on
        tiny_model_dir,
        "--codecs",
        "raw,seq,turbo3",
        "--continuation",
        "6",
        "--window",
        "32",
        "--json",
        out / "r.json",
        "--csv",
        out / "r.csv",
        "--parquet",
        out / "r.parquet",
        "--markdown",
        out / "r.md",
        "--plots",
        out / "plots",
    )
    assert result.exit_code == 0, result.output
    doc = json.loads((out / "r.json").read_text())
    return result, out, doc
