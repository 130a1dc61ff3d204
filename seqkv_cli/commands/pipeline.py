"""`seqkv pipeline`: the main job, end to end: capture -> compress -> verify -> summary."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from seqkv_cli.commands._common import console, handle_errors, human_bytes, say, shown
from seqkv_cli.commands.options import (
    DeviceOption,
    ModelOption,
    ThreadsOption,
    runs_model,
    token_progress,
)
from seqkv_cli.errors import SeqkvError


@handle_errors
@runs_model
def pipeline_command(
    inputs: Annotated[list[str], typer.Argument(help="Inputs, as for `seqkv capture`.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Run directory.")] = Path("runs/latest"),
    model: ModelOption = None,
    threads: ThreadsOption = None,
    device: DeviceOption = "auto",
    dtype: Annotated[str, typer.Option(help="K/V dtype: bf16, fp16 or fp32.")] = "bf16",
    baseline: Annotated[
        str, typer.Option(help="Per-vector codec to compare with (`seqkv codecs`).")
    ] = "turbo3",
    verify: Annotated[
        str,
        typer.Option(
            help="Decode and compare bit for bit: all sessions, a sample (the two "
            "shortest; decoding steps the model per token), or none."
        ),
    ] = "sample",
) -> None:
    """Capture inputs, compress them with seq and a per-vector baseline, verify, summarise."""
    from seqkv_cli.archive import capture_and_code, check_verify_mode, compress_captures
    from seqkv_cli.fsutil import refuse_output_in_inputs
    from seqkv_cli.kvcapture.api import input_files, prepare_capture
    from seqkv_cli.sequential.registry import resolve_codec

    check_verify_mode(verify)
    resolve_codec(baseline)
    out = Path(out)
    for archive in (out / "seq.skv", out / f"{baseline}.skv"):
        refuse_output_in_inputs(archive, input_files(inputs))  # before any capture runs
    lm, plan, targets = prepare_capture(
        inputs, model=model, out=out / "captures", dtype=dtype, progress=say
    )
    with token_progress() as bar:
        # One walk of the model captures and codes: a shared prefix is run once
        # (archive.capture_and_code)
        task = bar.add_task("capturing + coding (seq)", total=plan.total_tokens)
        seq, captures = capture_and_code(
            lm,
            plan,
            targets,
            out / "seq.skv",
            dtype=dtype,
            on_progress=lambda n: bar.advance(task, n),
        )
        task = bar.add_task(f"compressing ({baseline})", total=plan.total_tokens)
        base = compress_captures(
            targets,
            out / f"{baseline}.skv",
            codec=baseline,
            on_progress=lambda n: bar.advance(task, n),
        )
    exact = _verify(out / "seq.skv", lm, captures, verify)
    _summary(lm, captures, seq, base, baseline, exact)
    console.print(f"run written to {shown(out)} (captures/, seq.skv, {shown(baseline)}.skv)")


def _verify(path: Path, lm, captures, mode: str) -> dict[str, bool]:
    """Decode the chosen sessions of the seq container and compare them with the captures."""
    from seqkv_cli.archive import Archive, check_sessions, sessions_to_decode

    if mode == "none":
        return {}
    originals = {c.capture.session_id: c.capture for c in captures}
    with Archive(path, model=lm) as arc:
        arc.reader.verify()
        chosen = sessions_to_decode(arc.sessions, mode)
        say(f"verifying {len(chosen)} session(s) by decoding them")
        checks = check_sessions(arc, originals, chosen, measure=False)
    bad = [c for c in checks if not c.ok]
    if bad:
        raise SeqkvError(
            f"seq did not restore {', '.join(c.session_id for c in bad)} bit-exactly "
            f"({bad[0].problems[0]})",
            exit_code=1,
        )
    return {c.session_id: c.ok for c in checks}


def _summary(lm, captures, seq, base, baseline: str, exact: dict[str, bool]) -> None:
    from seqkv_cli.report.pipeline_summary import pipeline_summary

    summary = pipeline_summary(lm, [c.capture for c in captures], seq, base, exact)
    table = Table(
        title=f"seqkv pipeline: {shown(lm.name)} (fingerprint {shown(lm.fingerprint[:12])}), "
        f"bits per token position"
    )
    for col in (
        "session",
        "tokens",
        "log2 PP",
        "seq",
        "residual",
        f"{baseline}",
        "fp16",
        "seq vs fp16",
        "bit-exact",
    ):
        table.add_column(col, justify="left" if col == "session" else "right")
    for row in summary.sessions:
        table.add_row(
            shown(row.session),
            f"{row.tokens:,}",
            f"{row.log2_ppl:.3f}",
            f"{row.seq_bits:.3f}",
            human_bytes(row.residual_bytes),
            f"{row.baseline_bits:,.0f}",
            f"{row.fp16_bits:,}",
            f"{row.vs_fp16:,.0f}x",
            {True: "yes", False: "NO"}.get(row.exact, "-"),
        )
    table.add_section()
    row = summary.file
    table.add_row(
        row.session,
        f"{row.tokens:,}",
        f"{row.log2_ppl:.3f}",
        f"{row.seq_bits:.3f}",
        "",
        f"{row.baseline_bits:,.0f}",
        f"{row.fp16_bits:,}",
        f"{row.vs_fp16:,.0f}x",
        "",
    )
    console.print(table)
    console.print(
        f"seq.skv {human_bytes(summary.seq_file_bytes)}; {baseline}.skv "
        f"{human_bytes(summary.baseline_file_bytes)}; "
        f"captured K/V {human_bytes(summary.captured_kv_bytes)}"
    )
