"""`seqkv info`, `seqkv verify` and `seqkv codecs`: what is in a container, and is it right."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from seqkv_cli.commands._common import console, handle_errors, human_bytes, shown
from seqkv_cli.commands.capture import ModelOption
from seqkv_cli.errors import SeqkvError


@handle_errors
def info_command(archive: Annotated[Path, typer.Argument(help="The .skv file.")]) -> None:
    """Header, sessions, sizes per part and bits per position of a container."""
    from seqkv_cli.skv.accounting import account
    from seqkv_cli.skv.restore import Archive

    with Archive(archive) as arc:
        acc = account(arc)
        console.print(
            f"[bold]{shown(archive)}[/]  format {'.'.join(map(str, arc.reader.version))}, "
            f"{human_bytes(acc.file_bytes)}, codec {shown(arc.codec.codec_id)} "
            f"{shown(json.dumps(arc.codec.get_config()))}"
        )
        console.print(
            f"model {shown(arc.model.get('name', '?'))}  "
            f"fingerprint {shown(arc.model.get('fingerprint', '?'))}"
        )
        table = Table()
        for col in ("session", "positions", "dtype", "bytes", "bits/position", "log2 PP"):
            table.add_column(col, justify="left" if col == "session" else "right")
        for s in acc.sessions:
            ppl = s["log2_ppl"]
            table.add_row(
                shown(s["id"]),
                f"{s['positions']:,}",
                shown(s["dtype"]),
                human_bytes(s["bytes"]),
                _bits(s["bits_per_position"]),
                "-" if ppl is None else f"{ppl:.3f}",
            )
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


def _bits(x: float) -> str:
    return f"{x:,.3f}" if x < 100 else f"{x:,.1f}"


@handle_errors
def verify_command(
    archive: Annotated[Path, typer.Argument(help="The .skv file.")],
    against: Annotated[
        list[Path] | None,
        typer.Option("--against", help="Original capture files to check fidelity against."),
    ] = None,
    per_layer: Annotated[bool, typer.Option(help="Show every layer's errors.")] = False,
    model: ModelOption = None,
) -> None:
    """Check every checksum and decode every block; with --against, measure fidelity."""
    from seqkv_cli.kvcapture.capture_file import load_capture
    from seqkv_cli.skv.restore import Archive
    from seqkv_cli.skv.verify import restored_problems

    with Archive(archive, model=model) as arc:
        arc.reader.verify()
        originals = {}
        for path in against or []:
            cap = load_capture(path)
            originals[cap.session_id] = cap
        missing = set(originals) - {e["id"] for e in arc.sessions}
        if missing:
            raise SeqkvError(f"{archive} holds no session {sorted(missing)[0]!r} to compare with")
        table = Table(
            title=f"{shown(archive)}: integrity OK ({len(arc.sessions)} sessions, codec "
            f"{shown(arc.codec.codec_id)})"
        )
        for col in ("session", "exact", "max abs err", "rel L2 err", "attention err"):
            table.add_column(col, justify="left" if col == "session" else "right")
        failed = {}
        for entry, restored in arc.restore_many(arc.sessions):
            if isinstance(restored, Exception):
                raise restored
            original = originals.get(entry["id"])
            if original is None:
                table.add_row(shown(entry["id"]), "-", "-", "-", "-")
                continue
            problems = restored_problems(original, restored, arc.codec)
            if problems:
                failed[entry["id"]] = problems
            _fidelity_rows(table, entry["id"], original, restored, per_layer, problems)
        console.print(table)
        if failed:
            sid, problems = next(iter(failed.items()))
            which = "" if len(failed) == 1 else f"{sid}: "
            raise SeqkvError(
                f"codec {arc.codec.codec_id} did not restore {', '.join(failed)} "
                f"({which}{'; '.join(problems)})",
                exit_code=1,
            )


def _fidelity_rows(table, sid: str, original, restored, per_layer: bool, problems) -> None:
    """The session's error row (and one per layer); no numbers where the shapes differ."""
    from seqkv_cli.skv.fidelity import attention_error, compare
    from seqkv_cli.skv.verify import structure_problems

    if problems and structure_problems(original, restored):
        table.add_row(shown(sid), "no", "-", "-", "-")
        return
    rows = [
        compare(a, b, i, kind)
        for kind, xs, ys in (
            ("key", original.keys, restored.keys),
            ("value", original.values, restored.values),
        )
        for i, (a, b) in enumerate(zip(xs, ys, strict=True))
    ]
    exact = all(r.exact for r in rows)
    attn = attention_error(original.keys, original.values, restored.keys, restored.values)
    table.add_row(
        shown(sid),
        "yes" if exact else "no",
        f"{max(r.max_abs for r in rows):.3g}",
        f"{max(r.rel_l2 for r in rows):.3g}",
        f"{attn:.3g}",
    )
    if per_layer:
        for r in rows:
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
    from seqkv_cli.sequential.session_codecs import SESSION_CODECS

    for cls in [*SESSION_CODECS.values(), *available_codecs()]:
        bits = cls.typical_bits_per_component
        table.add_row(
            cls.codec_id,
            "lossless" if cls.lossless else "lossy",
            "-" if bits is None else f"{bits:g}",
            cls.description,
        )
    console.print(table)
