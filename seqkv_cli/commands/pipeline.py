"""`seqkv pipeline`: the main job on the embedded default, one command end to end."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from seqkv_cli.commands._common import console, handle_errors, human_bytes, say
from seqkv_cli.commands.capture import ModelOption, token_progress


@handle_errors
def pipeline_command(
    inputs: Annotated[list[str], typer.Argument(help="Inputs, as for `seqkv capture`.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Run directory.")] = Path("runs/latest"),
    model: ModelOption = None,
    dtype: Annotated[str, typer.Option(help="K/V dtype: bf16, fp16 or fp32.")] = "bf16",
) -> None:
    """Capture every input with canonical numerics and summarise tokens, log2 PP and bytes."""
    from seqkv_cli.kvcapture.api import capture_one, prepare_capture

    lm, plan, targets = prepare_capture(
        inputs, model=model, out=Path(out) / "captures", dtype=dtype, progress=say
    )
    table = Table(title=f"seqkv pipeline: {lm.name}, fingerprint {lm.fingerprint[:12]}")
    for col in ("session", "tokens", "log2 PP", "KV bytes", "file bytes"):
        table.add_column(col, justify="left" if col == "session" else "right")
    total_tokens = total_bits = total_bytes = 0
    with token_progress() as bar:
        task = bar.add_task("capturing", total=plan.total_tokens)
        for doc, ids, target in zip(plan.documents, plan.token_ids, targets, strict=True):
            res = capture_one(
                lm,
                doc,
                ids,
                target,
                dtype=dtype,
                canonical=True,
                on_progress=lambda n: bar.advance(task, n),
            )
            cap = res.capture
            table.add_row(
                doc.id,
                f"{cap.positions:,}",
                f"{cap.log2_ppl:.3f}",
                human_bytes(cap.kv_bytes()),
                human_bytes(res.bytes_written),
            )
            total_tokens += cap.positions
            total_bits += float(cap.surprisal.sum())
            total_bytes += res.bytes_written
    scored = total_tokens - len(plan.documents)
    table.add_section()
    table.add_row(
        "all",
        f"{total_tokens:,}",
        f"{total_bits / max(scored, 1):.3f}",
        "",
        human_bytes(total_bytes),
    )
    console.print(table)
    console.print(f"captures written to {Path(out) / 'captures'}")
