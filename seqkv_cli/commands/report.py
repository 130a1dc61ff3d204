"""`seqkv report`: bits per position vs log2 PP, baselines, fidelity, files, plots, CI gates."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from seqkv_cli.commands._common import console, handle_errors, say
from seqkv_cli.commands.options import DeviceOption, ThreadsOption, runs_model
from seqkv_cli.errors import SeqkvError


@handle_errors
@runs_model
def report_command(
    inputs: Annotated[
        list[Path],
        typer.Argument(help="Captures (.safetensors), .skv files, or folders of them."),
    ],
    codecs: Annotated[
        str | None,
        typer.Option(
            help="Comma-separated codecs to compute from the captures (`seqkv codecs`, plus "
            "hf-quanto2/hf-quanto4); default: seq, seq-fast, int8, turbo3, hf-quanto4."
        ),
    ] = None,
    model: Annotated[
        list[str] | None,
        typer.Option(
            "--model",
            "-m",
            help="Model for seq rows, decoding and continuation; repeat it for captures of "
            "several models (default: the model each capture names, where it names one: the "
            "embedded model or a hub id).",
        ),
    ] = None,
    threads: ThreadsOption = None,
    device: DeviceOption = "auto",
    verify: Annotated[
        bool,
        typer.Option(help="Decode every row and compare it with its capture (slow for seq)."),
    ] = True,
    continuation: Annotated[
        int,
        typer.Option(
            metavar="N",
            help="Lossy rows: perplexity change and greedy agreement over N generated tokens "
            "(needs the model; 0 = off).",
        ),
    ] = 0,
    window: Annotated[
        int, typer.Option(metavar="N", help="Positions per marginal-cost window.")
    ] = 64,
    json_out: Annotated[
        Path | None, typer.Option("--json", metavar="FILE", help="Write the report as JSON.")
    ] = None,
    csv_out: Annotated[
        Path | None, typer.Option("--csv", metavar="FILE", help="One CSV row per session x codec.")
    ] = None,
    parquet_out: Annotated[
        Path | None, typer.Option("--parquet", metavar="FILE", help="The same rows as Parquet.")
    ] = None,
    markdown_out: Annotated[
        Path | None,
        typer.Option("--markdown", metavar="FILE", help="A Markdown summary (CI job summary)."),
    ] = None,
    plots: Annotated[
        Path | None, typer.Option("--plots", metavar="DIR", help="Write PNG charts here.")
    ] = None,
    max_bits_per_position: Annotated[
        float | None, typer.Option(metavar="X", help="Gate: fail rows above X bits/position.")
    ] = None,
    max_gap: Annotated[
        float | None,
        typer.Option(metavar="R", help="Gate: fail rows whose bits/position ÷ log2 PP is above R."),
    ] = None,
    require_exact: Annotated[
        bool, typer.Option("--require-exact", help="Gate: fail rows not verified bit-exact.")
    ] = False,
) -> None:
    """Report bits per position against log2 PP for captures and .skv files; gate CI on it.

    Exit status: 0 when every gate passes, 1 when a threshold is crossed (the failing
    sessions are named), 2 for bad input.
    """
    from seqkv_cli.fsutil import check_output_file, ensure_writable_dir, refuse_output_in_inputs
    from seqkv_cli.report.collect import check_options
    from seqkv_cli.report.collect import report as build
    from seqkv_cli.report.gate import Thresholds, check, summary
    from seqkv_cli.report.table import session_table, summary_table

    limits = Thresholds(max_bits_per_position, max_gap, require_exact)
    names = [c.strip() for c in codecs.split(",") if c.strip()] if codecs is not None else None
    check_options(names, continuation, window)  # before any output file is looked at
    files = {"--json": json_out, "--csv": csv_out, "--parquet": parquet_out}
    files["--markdown"] = markdown_out
    read = [f for p in inputs for f in (p.iterdir() if p.is_dir() else [p])]
    for option, path in files.items():
        if path is not None:
            check_output_file(path, option, create_parent=True)
            refuse_output_in_inputs(path, read, option)
    if plots is not None:
        ensure_writable_dir(plots)
    report = build(
        list(inputs),
        codecs=names,
        model=model,
        verify=verify,
        continuation=continuation,
        window=window,
        progress=say,
    )
    for note in report.notes:
        say(f"note: {note}")
    if not report.rows:
        raise SeqkvError("nothing to report: no row could be computed (see the notes above)")
    console.print(session_table(report.rows, continuation))
    console.print(summary_table(report.rows))
    failures = check(report.rows, limits)
    _write(report, limits, failures, json_out, csv_out, parquet_out, markdown_out, plots)
    if failures:
        raise SeqkvError(summary(failures), exit_code=1)
    if limits.active:
        console.print(
            f"gate passed ({sum(r.role == 'subject' for r in report.rows)} row(s) checked)"
        )


def _write(report, limits, failures, json_out, csv_out, parquet_out, markdown_out, plots) -> None:
    """Every requested file, all or none; written before the gate decides the exit code."""
    from seqkv_cli.report import outputs

    written = []
    with outputs.OutputSet() as out:
        if json_out is not None:
            outputs.write_json(out, json_out, outputs.document(report, limits, failures))
        if csv_out is not None:
            outputs.write_csv(out, csv_out, report)
        if parquet_out is not None:
            outputs.write_parquet(out, parquet_out, report)
        if markdown_out is not None:
            text = outputs.markdown(report, failures, limits)
            outputs.write_markdown(out, markdown_out, text)
        if plots is not None:
            from seqkv_cli.report.plots import write_plots

            written = write_plots(out, report, plots)
    for path in written:
        say(f"wrote {path}")
