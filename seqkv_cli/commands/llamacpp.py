"""`seqkv import llama-state` and `seqkv export llama-state`: llama.cpp saved states."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from seqkv_cli.commands._common import console, handle_errors, human_bytes, say, shown
from seqkv_cli.commands.options import DeviceOption, ModelOption, ThreadsOption, runs_model

import_app = typer.Typer(
    help="Bring caches saved by other tools into an archive.", no_args_is_help=True
)
export_app = typer.Typer(
    help="Write archived sessions in other tools' formats.", no_args_is_help=True
)


class Kind(StrEnum):
    session = "session"
    sequence = "sequence"


class OnOff(StrEnum):
    on = "on"
    off = "off"


class CacheType(StrEnum):
    f32 = "f32"
    f16 = "f16"
    bf16 = "bf16"


@import_app.command("llama-state")
@handle_errors
@runs_model
def import_llama_state(
    files: Annotated[
        list[Path],
        typer.Argument(
            help="State files llama.cpp wrote: llama_state_save_file sessions, "
            "llama_state_seq_save_file sequences, llama-server /slots?action=save files."
        ),
    ],
    output: Annotated[
        Path, typer.Option("--output", "-o", help="The .skv archive (created or appended to).")
    ],
    model: ModelOption = None,
    tokens_only: Annotated[
        bool,
        typer.Option(
            "--tokens-only",
            help="Store the token lists only (llama.cpp re-prefills them, or export writes "
            "seqkv's recompute); default: llama.cpp's own K/V bytes, exactly.",
        ),
    ] = False,
    threads: ThreadsOption = None,
    device: DeviceOption = "auto",
) -> None:
    """Archive llama.cpp saved states (one session each, named after its file; shared
    prefixes such as a system prompt are stored once)."""
    from seqkv_cli.llamacpp.transfer import import_states

    report = import_states(list(files), output, model=model, tokens_only=tokens_only)
    for s in report.states:
        close = (
            f", K/V {100 * s.relative_difference:.1f} % from seqkv's recompute"
            if s.relative_difference is not None
            else ""
        )
        say(f"{s.id}: {s.tokens:,} tokens, {human_bytes(s.file_bytes)} state ({s.mode}{close})")
    ratio = report.state_bytes / max(report.added_bytes, 1)
    console.print(
        f"imported {len(report.states)} state(s), {human_bytes(report.state_bytes)}: "
        f"+{human_bytes(report.added_bytes)} to {shown(report.archive)} "
        f"({ratio:.1f}x smaller; file {human_bytes(report.file_bytes)})",
        highlight=False,
    )
    if tokens_only:
        say("tokens only: K/V are not kept; export writes seqkv's recompute, not llama.cpp's bits")


@export_app.command("llama-state")
@handle_errors
@runs_model
def export_llama_state(
    archive: Annotated[Path, typer.Argument(help="The .skv archive.")],
    session: Annotated[str, typer.Argument(help="The session id.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="The state file to write.")],
    model: ModelOption = None,
    kind: Annotated[
        Kind | None,
        typer.Option(
            help="session (llama_state_load_file) or sequence (llama_state_seq_load_file, "
            "llama-server slots); default: the imported file's kind, else sequence."
        ),
    ] = None,
    flash_attn: Annotated[
        OnOff | None,
        typer.Option(
            "--flash-attn",
            help="The loading context's flash attention (off: V stored transposed); "
            "default: the imported file's, else on (llama.cpp's -fa auto on CPU).",
        ),
    ] = None,
    cache_type: Annotated[
        CacheType | None,
        typer.Option(
            "--cache-type",
            help="The loading context's K/V cache type (-ctk/-ctv); default: the imported "
            "file's, else f16.",
        ),
    ] = None,
    threads: ThreadsOption = None,
    device: DeviceOption = "auto",
) -> None:
    """Write an archived session as a state file llama.cpp loads."""
    from seqkv_cli.llamacpp.transfer import export_state

    report = export_state(
        archive,
        session,
        output,
        model=model,
        kind=kind.value if kind else None,
        flash_attn=None if flash_attn is None else flash_attn is OnOff.on,
        cache_type=cache_type.value if cache_type else None,
    )
    console.print(
        f"wrote {shown(report.path)}: session {shown(report.id)}, {report.tokens:,} tokens, "
        f"{human_bytes(report.bytes)}; K/V: {report.kv}",
        highlight=False,
    )
