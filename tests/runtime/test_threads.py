"""--threads and the wait policy: what a shared machine needs (runtime/threads.py)."""

from __future__ import annotations

import torch
from typer.testing import CliRunner

from seqkv_cli.cli import app
from seqkv_cli.runtime.threads import use_threads, yield_when_idle


def test_threads_below_one_are_refused_in_one_line(tmp_path):
    for bad in ("0", "-2", "5000"):
        result = CliRunner().invoke(
            app,
            ["decompress", str(tmp_path / "x.skv"), "-o", str(tmp_path / "o"), "--threads", bad],
        )
        assert result.exit_code == 2
        assert f"got {bad}" in result.output and "--threads must be at" in result.output
        assert "Traceback" not in result.output


def test_threads_set_torch_and_none_keeps_the_default():
    before = torch.get_num_threads()
    try:
        assert use_threads(1) == 1 and torch.get_num_threads() == 1
        assert use_threads(None) == 1  # None changes nothing
    finally:
        torch.set_num_threads(before)


def test_the_cli_makes_idle_threads_yield_unless_the_user_chose(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    yield_when_idle()
    import os

    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    yield_when_idle()
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"


def test_progress_bars_show_tokens_per_second():
    from types import SimpleNamespace

    from seqkv_cli.commands.options import TokensPerSecond

    assert TokensPerSecond().render(SimpleNamespace(speed=12.345)).plain == "12.3 tokens/s"
    assert TokensPerSecond().render(SimpleNamespace(speed=None)).plain == ""
