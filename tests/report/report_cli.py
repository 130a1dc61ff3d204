"""Running `seqkv` in-process for the report tests."""

from __future__ import annotations

from typer.testing import CliRunner

from seqkv_cli.cli import app

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args], env={"COLUMNS": "220"})


def error_lines(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("error:")]
