"""`seqkv archive add|list|extract|compact` and `seqkv resume`: an archive of agent memory."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from seqkv_cli.commands._common import (
    console,
    err_console,
    handle_errors,
    human_bytes,
    print_columns,
    shown,
    visible,
)
from seqkv_cli.commands.options import (
    DeviceOption,
    ModelOption,
    ThreadsOption,
    restore_bar,
    runs_model,
    token_progress,
)

archive_app = typer.Typer(
    help="Multi-session archives: add sessions, list, extract one, compact.",
    no_args_is_help=True,
)
ArchiveArg = Annotated[
    Path,
    typer.Argument(help="The .skv archive (list/extract: or a sharded archive's directory)."),
]


LoadOption = Annotated[
    str | None,
    typer.Option(
        help="small: tokens coded under the model (fewest bytes; a restore steps the model "
        "once a token); fast: the tokens without the model (more bytes; one prefill). "
        "Default: the archive's own codec.",
    ),
]


def _waiting() -> None:
    err_console.print("another seqkv process is writing this archive; waiting for it")


@archive_app.command("add")
@handle_errors
@runs_model
def add_command(
    archive: ArchiveArg,
    captures: Annotated[list[Path], typer.Argument(help="Capture files to append.")],
    model: ModelOption = None,
    threads: ThreadsOption = None,
    device: DeviceOption = "auto",
    load: LoadOption = None,
) -> None:
    """Append sessions; only tokens no earlier session has at the same prefix are coded."""
    from seqkv_cli.archive import add_captures

    res = add_captures(archive, list(captures), model=model, on_wait=_waiting, load=load)
    console.print(
        f"added {res.sessions} session(s), {res.positions:,} positions, {res.new_tokens:,} new "
        f"tokens: +{human_bytes(res.added_bytes)} -> {human_bytes(res.file_bytes)}"
    )


@archive_app.command("list")
@handle_errors
def list_command(archive: ArchiveArg) -> None:
    """Sessions: id, tokens, bytes of their own, and how much prefix they share (a sharded
    archive: its directory or manifest.parquet, one row per session with its shard)."""
    from seqkv_cli.archive import manifest_file, session_rows

    if manifest_file(archive) is not None:
        _list_manifest(archive)
        return
    rows, note = session_rows(archive)
    table = Table(title=f"{shown(archive)}: {len(rows)} session(s)")
    for col in ("id", "tokens", "own bytes", "shared prefix", "segment", "load", "restore"):
        table.add_column(col, justify="left" if col == "id" else "right")
    for r in rows:
        table.add_row(
            shown(r["id"]),
            f"{r['positions']:,}",
            human_bytes(r["own_bytes"]),
            f"{r['shared_prefix']:,}",
            str(r["segment"]),
            r["load"],
            r["restore"],
        )
    console.print(table)
    if note:
        console.print(shown(note), highlight=False)


# Above this many rows a listing is printed as plain aligned columns (Rich tables render
# about a millisecond a row: 300,000 sessions would take minutes).
RICH_TABLE_ROWS = 2000


def _list_manifest(path: Path) -> None:
    from seqkv_cli.archive import read_manifest

    man = read_manifest(path)  # every row checked against its shard's header
    rows = man.rows
    title = f"{man.root}: {len(rows)} session(s) in {len(man.shards())} shard(s)"
    claim = "own bytes and shared prefix as the manifest records them"
    cells = {
        "id": rows["session_id"].map(visible).tolist(),
        "tokens": rows["tokens"].map("{:,}".format).tolist(),
        "own bytes": rows["bytes"].map(human_bytes).tolist(),
        "shared prefix": rows["shared_prefix"].map("{:,}".format).tolist(),
        "shard": rows["shard"].map(visible).tolist(),
    }
    if len(rows) > RICH_TABLE_ROWS:
        console.out(f"{visible(title)} ({claim})", highlight=False)
        print_columns(cells, left=("id", "shard"))
        return
    table = Table(title=shown(title), caption=claim)
    for col in cells:
        table.add_column(col, justify="left" if col in ("id", "shard") else "right")
    for row in zip(*cells.values(), strict=True):
        table.add_row(*(escape(c) for c in row))
    console.print(table)


@archive_app.command("extract")
@handle_errors
@runs_model
def extract_command(
    archive: ArchiveArg,
    session_id: Annotated[str, typer.Argument(help="The session id.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Capture file to write.")],
    model: ModelOption = None,
    threads: ThreadsOption = None,
    device: DeviceOption = "auto",
) -> None:
    """Restore one session (only the nodes on its path are decoded) as a capture file."""
    from seqkv_cli.archive import Archive
    from seqkv_cli.fsutil import check_output_file, refuse_output_in_inputs
    from seqkv_cli.kvcapture.capture_file import save_capture

    check_output_file(out, create_parent=True)
    from seqkv_cli.archive import manifest_file, read_manifest

    if manifest_file(archive) is not None:  # a sharded archive: the shard that holds the id
        # only the one shard is opened; Archive(model=...) below checks its model
        archive = read_manifest(archive, check_shards=False).shard_of(session_id)
    refuse_output_in_inputs(out, [archive])
    with Archive(archive, model=model) as arc, token_progress() as bar:
        arc.on_tokens = restore_bar(bar, f"restoring {shown(session_id)}")
        restored = arc.restore(arc.session(session_id))
    size = save_capture(restored, out)
    console.print(
        f"{shown(session_id)}: {restored.positions:,} positions -> {shown(out)} "
        f"({human_bytes(size)})",
        highlight=False,
    )


@archive_app.command("compact")
@handle_errors
@runs_model
def compact_command(
    archive: ArchiveArg,
    model: ModelOption = None,
    threads: ThreadsOption = None,
    device: DeviceOption = "auto",
    near_dup: Annotated[
        bool, typer.Option("--near-dup", help="Store near-duplicate sessions as edits.")
    ] = False,
    load: LoadOption = None,
    layout: Annotated[
        str,
        typer.Option(
            help="auto: a compact file (binary header, no capture provenance) where the "
            "sessions keep only tokens, else the full trie layout; compact: insist; trie: "
            "always the full layout."
        ),
    ] = "auto",
) -> None:
    """Rewrite the archive as one trie (folds appended segments; converts flat files)."""
    from seqkv_cli.archive import compact

    before = archive.stat().st_size if archive.is_file() else 0
    res = compact(
        archive, model=model, on_wait=_waiting, near_dup=near_dup, load=load, layout=layout
    )
    console.print(
        f"{shown(archive)}: {res.sessions} session(s), {human_bytes(before)} -> "
        f"{human_bytes(res.file_bytes)} ({res.layout} layout)",
        highlight=False,
    )


@handle_errors
@runs_model
def resume_command(
    archive: ArchiveArg,
    session_id: Annotated[str, typer.Argument(help="The session id.")],
    prompt: Annotated[str, typer.Option(help="Text appended after the session.")] = "",
    max_new_tokens: Annotated[int, typer.Option(min=1, max=4096)] = 64,
    model: ModelOption = None,
    threads: ThreadsOption = None,
    device: DeviceOption = "auto",
) -> None:
    """Restore a session into a transformers cache and continue it greedily."""
    from seqkv_cli.archive import Archive, continue_from
    from seqkv_cli.runtime.loading import load_model

    lm = load_model(model)
    with Archive(archive, model=lm) as arc:
        restored = arc.restore(arc.session(session_id))
    new = continue_from(lm, restored, prompt, max_new_tokens)
    console.print(lm.tokenizer.decode(new), highlight=False, markup=False)
