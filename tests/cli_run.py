"""Running the `seqkv` CLI in-process in tests: one runner, one way to read its errors."""

from __future__ import annotations

from typer.testing import CliRunner

from seqkv_cli.cli import app

runner = CliRunner()
COLUMNS = "220"  # wide enough that no table cell is cut


def invoke(*args, input: str | None = None, env: dict | None = None):
    """`seqkv ARGS...` (paths and numbers as strings) with a fixed terminal width."""
    return runner.invoke(
        app, [str(a) for a in args], input=input, env={"COLUMNS": COLUMNS, **(env or {})}
    )


def error_lines(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("error:")]


def assert_error(result, fragment: str, code: int = 2) -> None:
    """Exactly one `error:` line naming `fragment`, exit `code`, and no traceback."""
    assert result.exit_code == code, (result.output, result.exception)
    errors = error_lines(result)
    assert len(errors) == 1 and fragment in errors[0], result.stderr
    assert "Traceback" not in result.output
