"""`seqkv compress` and `seqkv decompress`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from seqkv_cli.commands._common import console, err_console, handle_errors, human_bytes, shown
from seqkv_cli.commands.options import (
    DeviceOption,
    ModelOption,
    ThreadsOption,
    restore_bar,
    runs_model,
    token_progress,
)
from seqkv_cli.errors import SeqkvError


@handle_errors
@runs_model
def compress_command(
    captures: Annotated[
        list[Path],
        typer.Argument(
            help="Capture files (.safetensors), or session datasets (.jsonl/.parquet: one "
            "session a row, an id and messages, text or token_ids)."
        ),
    ],
    out: Annotated[
        Path,
        typer.Option(
            "--out",
            "-o",
            help="The .skv file to write; for datasets, a directory gets shards grouped by "
            "shared prefix and a manifest.parquet.",
        ),
    ],
    codec: Annotated[str, typer.Option(help="Codec id; `seqkv codecs` lists them.")] = "seq",
    model: ModelOption = None,
    threads: ThreadsOption = None,
    device: DeviceOption = "auto",
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
    parallel: Annotated[
        int,
        typer.Option(
            "--parallel",
            metavar="N",
            help="seq: code each session as N runs that restore side by side (about N times "
            "fewer model passes; each run loses the context before it, which costs bits: "
            "docs/BENCHMARKS.md). Sessions are then coded each on its own (flat layout).",
        ),
    ] = 1,
    near_dup: Annotated[
        bool,
        typer.Option(
            "--near-dup",
            help="seq/seq-fast trie: store sessions whose prefix differs from another's by a "
            "small edit as edits of it (docs/BENCHMARKS.md, near-duplicate prefixes).",
        ),
    ] = False,
    numerics: Annotated[
        str | None,
        typer.Option(
            help="Canonical numeric path of seq/seq-fast: 'portable' (portable-fx53-v3), "
            "'portable-v2', 'portable-v1' or 'legacy'. Default: the portable path the captures "
            "were made on, else 'portable'.",
        ),
    ] = None,
    ray: Annotated[
        str | None,
        typer.Option(
            "--ray",
            metavar="ADDRESS",
            help="Datasets into a directory: run on Ray Data. 'local' starts a cluster here, "
            "'auto' joins a running one, or a cluster address (ray://host:10001).",
        ),
    ] = None,
    workers: Annotated[int, typer.Option(min=1, help="Ray: model actors.")] = 1,
    cpus_per_worker: Annotated[float, typer.Option(min=0.01, help="Ray: CPUs an actor.")] = 1.0,
    gpus_per_worker: Annotated[float, typer.Option(min=0, help="Ray: GPUs an actor.")] = 0.0,
    prefix_tokens: Annotated[
        int,
        typer.Option(min=1, help="Datasets: sessions whose first N tokens agree share a shard."),
    ] = 64,
    shard_sessions: Annotated[int, typer.Option(min=1, help="Datasets: sessions a shard.")] = 1000,
    shard_tokens: Annotated[
        int, typer.Option(min=1, help="Datasets: tokens a shard (a byte target's proxy).")
    ] = 2_000_000,
    strict: Annotated[
        bool,
        typer.Option(
            "--strict",
            help="Datasets: refuse a session longer than the model context (default: "
            "skip it and count it).",
        ),
    ] = False,
) -> None:
    """Compress captures (or session datasets) into self-describing .skv containers."""
    from seqkv_cli.kvcapture.rows import is_dataset

    datasets = [p for p in captures if is_dataset(p)]
    if datasets:
        if len(datasets) != len(captures):
            raise SeqkvError("give capture files or session datasets, not both")
        if parallel != 1:
            raise SeqkvError("--parallel applies to capture files; datasets become trie shards")
        from seqkv_cli.runtime.numerics import resolve
        from seqkv_cli.scale.common import DatasetOptions

        options = DatasetOptions(
            prefix_tokens, shard_sessions, shard_tokens, strict, codec, resolve(numerics), verify
        )
        _compress_datasets(
            datasets, out, model, options, ray, workers, cpus_per_worker, gpus_per_worker
        )
        return
    if ray is not None:
        raise SeqkvError("--ray runs session datasets (.jsonl/.parquet), not capture files")
    from seqkv_cli.archive import codec_spec, compress_captures
    from seqkv_cli.fsutil import check_output_file, refuse_output_in_inputs
    from seqkv_cli.kvcapture.capture_file import load_capture_meta

    spec = codec_spec(
        codec, residual=residual, tolerance=tolerance, numerics=numerics, parallel=parallel
    )
    check_output_file(out)
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


def _compress_datasets(paths, out, model, options, ray, workers, cpus, gpus) -> None:
    from seqkv_cli.fsutil import check_output_file, refuse_output_in_inputs
    from seqkv_cli.scale.local import compress_dataset, compress_dataset_to_file

    refuse_output_in_inputs(out, paths)
    if out.suffix == ".skv":
        if ray is not None:
            raise SeqkvError("--ray writes shards into a directory; give -o a directory")
        check_output_file(out)
        res = compress_dataset_to_file(paths, out, model, options)
        console.print(
            f"{shown(out)}: {res.sessions} session(s), {res.positions:,} positions, "
            f"{human_bytes(res.file_bytes)} ({res.file_bytes * 8 / max(res.positions, 1):.2f} "
            f"bits/position, {res.layout} layout)",
            highlight=False,
        )
        return
    res = compress_dataset(
        paths,
        out,
        model,
        options=options,
        ray_address=ray,
        workers=workers,
        cpus_per_worker=cpus,
        gpus_per_worker=gpus,
        on_progress=lambda line: err_console.print(line, highlight=False),
    )
    console.print(
        f"{shown(out)}: {res.sessions:,} session(s) in {res.shards} shard(s) "
        f"({res.skipped_shards} already complete), {res.tokens:,} tokens, "
        f"{human_bytes(res.file_bytes)} ({res.file_bytes * 8 / max(res.tokens, 1):.2f} "
        f"bits/position); manifest {shown(res.manifest)}",
        highlight=False,
    )
    if res.too_long:
        console.print(
            f"skipped {res.too_long} session(s) longer than the model context (--strict refuses)"
        )
    if res.removed:
        console.print(f"removed {len(res.removed)} shard file(s) of an earlier plan")


@handle_errors
@runs_model
def decompress_command(
    archive: Annotated[Path, typer.Argument(help="The .skv file.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Directory for capture files.")],
    model: ModelOption = None,
    threads: ThreadsOption = None,
    device: DeviceOption = "auto",
    session: Annotated[
        list[str] | None, typer.Option("--session", help="Only this session id (repeatable).")
    ] = None,
) -> None:
    """Restore sessions of a container as capture files (safetensors)."""
    from seqkv_cli.archive import decompress

    with token_progress() as bar:
        paths = decompress(
            archive,
            out,
            session or None,
            on_session=lambda e, p: console.print(f"{shown(e['id'])}: {shown(p)}", highlight=False),
            model=model,
            on_tokens=restore_bar(bar),
        )
    console.print(f"restored {len(paths)} session(s) into {shown(out)}", highlight=False)
