"""`seqkv capture`: run a model over inputs and write capture files."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    TextColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from rich.text import Text

from seqkv_cli.commands._common import (
    console,
    err_console,
    handle_errors,
    human_bytes,
    say,
    shown,
)

ModelOption = Annotated[
    str | None,
    typer.Option("--model", "-m", help="Model folder, .gguf file or hub id (default: embedded)."),
]
ThreadsOption = Annotated[
    int | None,
    typer.Option(
        "--threads",
        metavar="N",
        help="CPU threads for the model (default: one per core; idle threads yield to other "
        "processes). The portable path gives the same bits with any N.",
    ),
]
DeviceOption = Annotated[
    str,
    typer.Option(
        "--device",
        metavar="auto|cpu|cuda[:N]",
        help="Where the model runs: auto (a CUDA GPU when there is one), cpu or cuda. The "
        "portable path writes and reads the same bytes on either.",
    ),
]
NumericsOption = Annotated[
    str,
    typer.Option(
        help="Canonical numeric path: 'portable' (same bits on any machine, thread count or "
        "device; the default, portable-fx53-v3), 'portable-v2' or 'portable-v1' (the versions "
        "of seqkv 0.3-0.4 and 0.2) or 'legacy' (the earlier fp32 forward: same machine class "
        "only).",
    ),
]


class TokensPerSecond(ProgressColumn):
    """The measured rate: a slow or busy machine shows itself while the job runs."""

    def render(self, task) -> Text:
        return Text(
            f"{task.speed:,.1f} tokens/s" if task.speed else "", style="progress.data.speed"
        )


def token_progress() -> Progress:
    """Tokens done, tokens/s (a slow or busy machine shows itself) and time left."""
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("tokens"),
        TokensPerSecond(),
        TimeRemainingColumn(),
        console=err_console,
        transient=True,
    )


def restore_bar(bar: Progress, what: str = "restoring"):
    """An `Archive.on_tokens` callback that moves a `token_progress` bar (its total is known
    once the restore has planned which tokens it decodes)."""
    task = bar.add_task(what, total=None)
    return lambda done, total: bar.update(task, completed=done, total=total)


@handle_errors
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
