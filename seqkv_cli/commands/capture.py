"""`seqkv capture`: run a model over inputs and write capture files."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from seqkv_cli.commands._common import console, handle_errors, human_bytes, say, shown
from seqkv_cli.commands.options import (
    DeviceOption,
    ModelOption,
    NumericsOption,
    ThreadsOption,
    runs_model,
    token_progress,
)


@handle_errors
@runs_model
def capture_command(
    inputs: Annotated[
        list[str],
        typer.Argument(
            help="Text files, directories, .jsonl chat sessions, or - for stdin.",
            show_default=False,
        ),
    ],
    out: Annotated[
        Path,
        typer.Option(
            "--out", "-o", help="Output directory, or a .safetensors file for a single session."
        ),
    ] = Path("captures"),
    model: ModelOption = None,
    threads: ThreadsOption = None,
    device: DeviceOption = "auto",
    dtype: Annotated[str, typer.Option(help="K/V dtype to store: bf16, fp16 or fp32.")] = "bf16",
    canonical: Annotated[
        bool,
        typer.Option(
            help="Canonical numerics (bit-reproducible in any "
            "chunking) or an ordinary transformers run."
        ),
    ] = True,
    max_tokens: Annotated[
        int | None, typer.Option(help="Keep at most this many tokens per session.")
    ] = None,
    truncate: Annotated[
        bool,
        typer.Option(help="Cut inputs longer than the model context instead of refusing them."),
    ] = False,
    numerics: NumericsOption = "portable",
) -> None:
    """Capture the KV cache, token ids and per-token surprisal of each input session."""
    from seqkv_cli.kvcapture.api import capture_planned, prepare_capture

    lm, plan, targets = prepare_capture(
        inputs,
        model=model,
        out=out,
        dtype=dtype,
        max_tokens=max_tokens,
        truncate=truncate,
        progress=say,
    )
    from seqkv_cli.runtime.numerics import resolve

    path = resolve(numerics)
    mode = f"canonical {path}" if canonical else "ordinary"
    table = Table(title=f"captured with {shown(lm.name)} ({mode} numerics, {dtype})")
    for col in ("session", "tokens", "log2 PP (bits/token)", "file", "bytes"):
        table.add_column(col, justify="left" if col in ("session", "file") else "right")
    with token_progress() as bar:
        task = bar.add_task("capturing", total=plan.total_tokens)
        for res in capture_planned(
            lm,
            plan,
            targets,
            dtype=dtype,
            canonical=canonical,
            numerics=path,
            on_progress=lambda n: bar.advance(task, n),
            on_start=lambda doc: bar.update(task, description=f"capturing {shown(doc.id)}"),
        ):
            table.add_row(
                shown(res.document.id),
                str(res.capture.positions),
                f"{res.capture.log2_ppl:.3f}",
                shown(res.path),
                human_bytes(res.bytes_written),
            )
    console.print(table)
