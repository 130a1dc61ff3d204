"""`seqkv info`, `seqkv verify` and `seqkv codecs`: what is in a container, and is it right."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from seqkv_cli.commands._common import console, handle_errors, human_bytes, human_seconds, shown
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
def info_command(
    archive: Annotated[Path, typer.Argument(help="The .skv file.")],
    restore_time: Annotated[
        bool,
        typer.Option(
            "--restore-time",
            help="Estimate the restore time on this machine (loads the model, times a few "
            "passes of its canonical forward; per-vector codecs restore one session).",
        ),
    ] = False,
    model: ModelOption = None,
    threads: ThreadsOption = None,
    device: DeviceOption = "auto",
) -> None:
    """Header, sessions, sizes per part and bits per position of a container."""
    from seqkv_cli.archive import Archive, account

    with Archive(archive, model=model) as arc:
        acc = account(arc)
        estimate = _estimate(arc) if restore_time else None
        console.print(
            f"[bold]{shown(archive)}[/]  format {'.'.join(map(str, arc.reader.version))}, "
            f"{human_bytes(acc.file_bytes)}, codec {shown(arc.codec.codec_id)} "
            f"{shown(json.dumps(arc.codec.get_config()))}"
        )
        if getattr(arc.reader, "compact", None) is not None:
            kind = "archive" if arc.reader.archive else "single-session file"
            console.print(
                f"compact {kind}: model fingerprint "
                f"{shown(arc.model['fingerprint'])}... (its first 8 bytes); capture provenance "
                "not kept (`seqkv compress --layout trie` keeps it)"
            )
        else:
            console.print(
                f"model {shown(arc.model.get('name', '?'))}  "
                f"fingerprint {shown(arc.model.get('fingerprint', '?'))}"
            )
        table = Table()
        cols = ["session", "positions", "dtype", "bytes", "bits/position", "log2 PP"]
        cols += ["restore alone (est.)"] if estimate else []
        for col in cols:
            table.add_column(col, justify="left" if col == "session" else "right")
        for s in acc.sessions:
            ppl = s["log2_ppl"]
            cells = [
                shown(s["id"]),
                f"{s['positions']:,}",
                shown(s["dtype"]),
                human_bytes(s["bytes"]),
                _bits(s["bits_per_position"]),
                "-" if ppl is None else f"{ppl:.3f}",
            ]
            if estimate:
                cells.append(human_seconds(estimate.per_session[s["id"]]))
            table.add_row(*cells)
        console.print(table)
        parts = Table(title="bits per position by part")
        for col in ("part", "bytes", "bits/position", "share"):
            parts.add_column(col, justify="left" if col == "part" else "right")
        for part, n in acc.parts.items():
            parts.add_row(
                shown(part),
                human_bytes(n),
                f"{n * 8 / max(acc.positions, 1):,.2f}",
                f"{100 * n / max(acc.file_bytes, 1):.1f}%",
            )
        parts.add_section()
        parts.add_row("total", human_bytes(acc.file_bytes), f"{acc.bits_per_position:,.2f}", "100%")
        console.print(parts)
        if acc.log2_ppl is not None:
            console.print(
                f"mean surprisal of the same tokens (log2 PP): {acc.log2_ppl:.3f} "
                f"bits; file / log2 PP: {acc.bits_per_position / acc.log2_ppl:.3f}"
            )
        console.print(
            f"vs fp16 K/V ({acc.fp16_bits_per_position:,} bits/position): "
            f"{acc.fp16_bits_per_position / max(acc.bits_per_position, 1e-9):.2f}x"
        )
        if estimate:
            console.print(
                f"restore on this machine (estimated): {human_seconds(estimate.seconds)} for all "
                f"{len(acc.sessions):,} session(s), {estimate.tokens:,} tokens decoded, "
                f"{estimate.tokens_per_s:,.1f} tokens/s; {shown(estimate.basis)}"
            )


def _estimate(arc):
    from seqkv_cli.archive import estimate_restore

    with console.status("estimating restore time"):
        return estimate_restore(arc)


def _bits(x: float) -> str:
    return f"{x:,.3f}" if x < 100 else f"{x:,.1f}"


@handle_errors
@runs_model
def verify_command(
    archive: Annotated[Path, typer.Argument(help="The .skv file.")],
    against: Annotated[
        list[Path] | None,
        typer.Option("--against", help="Original capture files to check fidelity against."),
    ] = None,
    per_layer: Annotated[bool, typer.Option(help="Show every layer's errors.")] = False,
    model: ModelOption = None,
    threads: ThreadsOption = None,
    device: DeviceOption = "auto",
) -> None:
    """Check every checksum and decode every block; with --against, measure fidelity."""
    from seqkv_cli.archive import Archive, check_sessions
    from seqkv_cli.kvcapture.capture_file import load_capture

    with Archive(archive, model=model) as arc:
        arc.reader.verify()
        originals = {}
        for path in against or []:
            cap = load_capture(path)
            originals[cap.session_id] = cap
        with token_progress() as bar:
            arc.on_tokens = restore_bar(bar, "decoding")
            checks = check_sessions(arc, originals)
        table = Table(
            title=f"{shown(archive)}: integrity OK ({len(arc.sessions)} sessions, codec "
            f"{shown(arc.codec.codec_id)})"
        )
        for col in ("session", "exact", "max abs err", "rel L2 err", "attention err"):
            table.add_column(col, justify="left" if col == "session" else "right")
        for check in checks:
            _fidelity_rows(table, check, per_layer)
        console.print(table)
        failed = [c for c in checks if not c.ok]
        if failed:
            which = "" if len(failed) == 1 else f"{failed[0].session_id}: "
            raise SeqkvError(
                f"codec {arc.codec.codec_id} did not restore "
                f"{', '.join(c.session_id for c in failed)} "
                f"({which}{'; '.join(failed[0].problems)})",
                exit_code=1,
            )


def _fidelity_rows(table, check, per_layer: bool) -> None:
    """The session's error row (and one per layer); no numbers where the shapes differ."""
    if not check.compared:
        table.add_row(shown(check.session_id), "-", "-", "-", "-")
        return
    if check.errors is None:
        table.add_row(shown(check.session_id), "no", "-", "-", "-")
        return
    table.add_row(
        shown(check.session_id),
        "yes" if check.exact else "no",
        f"{check.max_abs:.3g}",
        f"{check.rel_l2:.3g}",
        f"{check.attention_error:.3g}",
    )
    if per_layer:
        for r in check.errors:
            table.add_row(
                f"  layer {r.layer} {r.kind}",
                "yes" if r.exact else "no",
                f"{r.max_abs:.3g}",
                f"{r.rel_l2:.3g}",
                "",
            )


@handle_errors
def codecs_command() -> None:
    """List the available codecs."""
    from seqkv_codecs.registry import available_codecs

    table = Table()
    for col in ("id", "kind", "typical bits/component", "description"):
        table.add_column(col)
    from seqkv_cli.sequential.registry import session_codec_classes

    for cls in [*session_codec_classes(), *available_codecs()]:
        bits = cls.typical_bits_per_component
        table.add_row(
            cls.codec_id,
            "lossless" if cls.lossless else "lossy",
            "-" if bits is None else f"{bits:g}",
            cls.description,
        )
    console.print(table)
