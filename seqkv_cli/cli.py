"""The `seqkv` command line: one Typer app, one small module per command."""

from __future__ import annotations

from typing import Annotated

import typer

from seqkv_cli.commands.archive import archive_app, resume_command
from seqkv_cli.commands.capture import capture_command
from seqkv_cli.commands.compress import compress_command, decompress_command
from seqkv_cli.commands.inspect import codecs_command, info_command, verify_command
from seqkv_cli.commands.llamacpp import export_app, import_app
from seqkv_cli.commands.model import model_app
from seqkv_cli.commands.pipeline import pipeline_command
from seqkv_cli.commands.report import report_command
from seqkv_cli.version import __version__

app = typer.Typer(
    help="Capture transformer KV caches, compress them as sequences, restore and report them.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,  # locals can be gigabytes of tensors
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"seqkv {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_version, is_eager=True, help="Show the version and exit."
        ),
    ] = False,
) -> None:
    """seqkv: KV caches as sequences, measured against log2(perplexity)."""


app.command("capture")(capture_command)
app.command("compress")(compress_command)
app.command("decompress")(decompress_command)
app.command("verify")(verify_command)
app.command("info")(info_command)
app.command("codecs")(codecs_command)
app.command("pipeline")(pipeline_command)
app.command("report")(report_command)
app.add_typer(model_app, name="model")
app.add_typer(archive_app, name="archive")
app.command("resume")(resume_command)
app.add_typer(import_app, name="import")
app.add_typer(export_app, name="export")


def main() -> None:
    from seqkv_cli.runtime.threads import yield_when_idle

    yield_when_idle()  # before torch loads its OpenMP runtime
    app()
