"""`seqkv compress` and `seqkv decompress`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from seqkv_cli.commands._common import console, handle_errors, human_bytes, shown
from seqkv_cli.commands.capture import ModelOption, NumericsOption, ThreadsOption, token_progress
from seqkv_cli.errors import SeqkvError


@handle_errors
def compress_command(
    captures: Annotated[list[Path], typer.Argument(help="Capture files (.safetensors).")],
    out: Annotated[Path, typer.Option("--out", "-o", help="The .skv file to write.")],
    codec: Annotated[str, typer.Option(help="Codec id; `seqkv codecs` lists them.")] = "seq",
    model: ModelOption = None,
    threads: ThreadsOption = None,
    residual: Annotated[
        str,
        typer.Option(
            help="seq/seq-fast: 'lossless' stores what recomputation misses; "
            "'none' refuses captures that do not recompute exactly."
        ),
    ] = "lossless",
    tolerance: Annotated[
        float | None,
        typer.Option(
            help="seq/seq-fast: drop K/V residuals below EPS and quantize the rest "
            "(max error <= EPS, verified); default: exact."
        ),
    ] = None,
    verify: Annotated[
        bool, typer.Option(help="Decode every block again before reporting success.")
    ] = True,
    layout: Annotated[
        str,
        typer.Option(
            help="'auto': a trie archive, or for one seq/seq-fast session a compact file "
            "(~45 bytes of framing; capture provenance not kept); 'trie' stores prefixes that "
            "sessions share once and keeps provenance; 'compact' insists on the compact file; "
            "'flat' codes each session on its own."
        ),
    ] = "auto",
    near_dup: Annotated[
        bool,
        typer.Option(
            "--near-dup",
            help="seq/seq-fast trie: store sessions whose prefix differs from another's by a "
            "small edit as edits of it (docs/BENCHMARKS.md, near-duplicate prefixes).",
        ),
    ] = False,
    numerics: NumericsOption = "portable",
) -> None:
    """Compress captures into one self-describing .skv container."""
    from seqkv_cli.fsutil import refuse_output_in_inputs
    from seqkv_cli.kvcapture.capture_file import load_capture_meta
    from seqkv_cli.sequential.registry import (
        codec_capabilities,
        resolve_codec,
        session_codec_classes,
    )
    from seqkv_cli.skv.compress import compress_captures

    if tolerance is not None and tolerance <= 0:
        raise SeqkvError(f"--tolerance must be > 0, got {tolerance}")
    caps = codec_capabilities(codec)
    if caps is not None and caps.takes_residual:
        from seqkv_cli.runtime.numerics import resolve

        spec = {"id": codec, "residual": residual, "numerics": resolve(numerics)}
        if tolerance is not None:
            spec["tolerance"] = tolerance
    elif tolerance is not None:
        takers = [c.codec_id for c in session_codec_classes() if c.takes_residual]
        raise SeqkvError(f"--tolerance applies to {', '.join(takers)}, not {codec}")
    else:
        spec = codec
    resolve_codec(spec)  # refuse an unknown id before reading any capture
    refuse_output_in_inputs(out, captures)
    total = sum(load_capture_meta(p)["positions"] for p in captures)
    with token_progress() as bar:
        task = bar.add_task(f"compressing ({codec})", total=total)
        res = compress_captures(
            list(captures),
            out,
            codec=spec,
            model=model,
            check=verify,
            layout=layout,
            near_dup=near_dup,
            on_progress=lambda n: bar.advance(task, n),
        )
    bits = res.file_bytes * 8 / max(res.positions, 1)
    table = Table(title=f"{shown(out)}: {res.sessions} session(s), {res.positions:,} positions")
    for col in ("part", "bytes", "bits/position"):
        table.add_column(col, justify="left" if col == "part" else "right")
    for part, n in sorted(res.part_bytes.items()):
        table.add_row(part, human_bytes(n), f"{n * 8 / max(res.positions, 1):,.1f}")
    table.add_section()
    table.add_row("total", human_bytes(res.file_bytes), f"{bits:,.1f}")
    console.print(table)
    console.print(
        f"K/V {human_bytes(res.input_kv_bytes)} -> {human_bytes(res.file_bytes)} file "
        f"({res.input_kv_bytes / max(res.file_bytes, 1):.2f}x) with {codec}, {res.layout} layout"
    )


@handle_errors
def decompress_command(
    archive: Annotated[Path, typer.Argument(help="The .skv file.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Directory for capture files.")],
    model: ModelOption = None,
    threads: ThreadsOption = None,
    session: Annotated[
        list[str] | None, typer.Option("--session", help="Only this session id (repeatable).")
    ] = None,
) -> None:
    """Restore sessions of a container as capture files (safetensors)."""
    from seqkv_cli.skv.decompress import decompress

    paths = decompress(
        archive,
        out,
        session or None,
        on_session=lambda e, p: console.print(f"{shown(e['id'])}: {shown(p)}", highlight=False),
        model=model,
    )
    console.print(f"restored {len(paths)} session(s) into {shown(out)}", highlight=False)
