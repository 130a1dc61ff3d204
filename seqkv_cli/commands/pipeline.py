"""`seqkv pipeline`: the main job, end to end: capture -> compress -> verify -> summary."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from seqkv_cli.commands._common import console, handle_errors, human_bytes, say, shown
from seqkv_cli.commands.capture import ModelOption, token_progress
from seqkv_cli.errors import SeqkvError

VERIFY_CHOICES = ("all", "sample", "none")


@handle_errors
def pipeline_command(
    inputs: Annotated[list[str], typer.Argument(help="Inputs, as for `seqkv capture`.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Run directory.")] = Path("runs/latest"),
    model: ModelOption = None,
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
    from seqkv_cli.fsutil import refuse_output_in_inputs
    from seqkv_cli.kvcapture.api import capture_one, input_files, prepare_capture
    from seqkv_cli.skv.compress import compress_captures, resolve_codec

    if verify not in VERIFY_CHOICES:
        raise SeqkvError(f"--verify must be one of {', '.join(VERIFY_CHOICES)}, not '{verify}'")
    resolve_codec(baseline)
    out = Path(out)
    for archive in (out / "seq.skv", out / f"{baseline}.skv"):
        refuse_output_in_inputs(archive, input_files(inputs))  # before any capture runs
    lm, plan, targets = prepare_capture(
        inputs, model=model, out=out / "captures", dtype=dtype, progress=say
    )
    captures = []
    with token_progress() as bar:
        task = bar.add_task("capturing", total=plan.total_tokens)
        for doc, ids, target in zip(plan.documents, plan.token_ids, targets, strict=True):
            captures.append(
                capture_one(
                    lm,
                    doc,
                    ids,
                    target,
                    dtype=dtype,
                    canonical=True,
                    on_progress=lambda n: bar.advance(task, n),
                )
            )
        task = bar.add_task("compressing (seq)", total=plan.total_tokens)
        seq = compress_captures(
            targets,
            out / "seq.skv",
            codec="seq",
            model=lm,
            check=False,
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
    from seqkv_cli.skv.restore import Archive
    from seqkv_cli.skv.verify import restored_problems

    if mode == "none":
        return {}
    by_id = {c.capture.session_id: c.capture for c in captures}
    with Archive(path, model=lm) as arc:
        arc.reader.verify()
        entries = sorted(arc.sessions, key=lambda e: e["positions"])
        chosen = entries if mode == "all" else entries[:2]
        say(f"verifying {len(chosen)} session(s) by decoding them")
        result, problems = {}, {}
        for entry, restored in arc.restore_many(chosen):
            if isinstance(restored, Exception):
                raise restored
            problems[entry["id"]] = restored_problems(by_id[entry["id"]], restored, arc.codec)
            result[entry["id"]] = not problems[entry["id"]]
    bad = [k for k, ok in result.items() if not ok]
    if bad:
        raise SeqkvError(
            f"seq did not restore {', '.join(bad)} bit-exactly ({problems[bad[0]][0]})",
            exit_code=1,
        )
    return result


def _summary(lm, captures, seq, base, baseline: str, exact: dict[str, bool]) -> None:
    from seqkv_cli.skv.accounting import account
    from seqkv_cli.skv.restore import Archive

    with Archive(seq.path, model=lm) as arc:
        entries, per_session = arc.sessions, account(arc).sessions
    fp16_bits = lm.num_layers * lm.num_kv_heads * lm.head_dim * 2 * 16
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
    base_per_pos = base.part_bytes["kv"] * 8 / base.positions
    for cap, entry, acc in zip(captures, entries, per_session, strict=True):
        c, bits, residual = cap.capture, acc["bits_per_position"], entry["residual_bytes"]
        table.add_row(
            shown(c.session_id),
            f"{c.positions:,}",
            f"{c.log2_ppl:.3f}",
            f"{bits:.3f}",
            human_bytes(residual),
            f"{base_per_pos:,.0f}",
            f"{fp16_bits:,}",
            f"{fp16_bits / bits:,.0f}x",
            {True: "yes", False: "NO"}.get(exact.get(c.session_id), "-"),
        )
    table.add_section()
    total_pos = seq.positions
    log2_ppl = sum(float(c.capture.surprisal.sum()) for c in captures) / max(
        total_pos - len(captures), 1
    )
    table.add_row(
        "all (file)",
        f"{total_pos:,}",
        f"{log2_ppl:.3f}",
        f"{seq.file_bytes * 8 / total_pos:.3f}",
        "",
        f"{base_per_pos:,.0f}",
        f"{fp16_bits:,}",
        f"{fp16_bits * total_pos / (seq.file_bytes * 8):,.0f}x",
        "",
    )
    console.print(table)
    console.print(
        f"seq.skv {human_bytes(seq.file_bytes)}; {baseline}.skv "
        f"{human_bytes(base.file_bytes)}; captured K/V {human_bytes(seq.input_kv_bytes)}"
    )
