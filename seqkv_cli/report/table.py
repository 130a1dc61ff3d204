"""The terminal view of a report: per-session rows, then where the bits go per codec."""

from __future__ import annotations

from pathlib import Path

from rich.markup import escape
from rich.table import Table

from seqkv_cli.report.aggregate import by_codec
from seqkv_cli.report.row import PARTS, Row


def session_table(rows: list[Row], continuation: int) -> Table:
    table = Table(title="seqkv report: bits per token position vs log2 PP")
    cols = ["session", "codec", "positions", "bits/pos", "log2 PP", "gap (x)", "gap bits"]
    cols += ["vs fp16", "vs turbo3", "exact", "max abs err", "attn err", "residual p95 K / V"]
    if continuation:
        cols += ["Δlog2 PP", f"greedy agree ({continuation})"]
    for col in cols:
        table.add_column(col, justify="left" if col in ("session", "codec") else "right")
    model = None
    for r in rows:
        if r.model_fingerprint != model:
            if model is not None:
                table.add_section()
            model = r.model_fingerprint
        cells = [escape(r.id), escape(codec_label(r)), f"{r.positions:,}", num(r.bits_per_position)]
        cells += [num(r.log2_ppl), num(r.gap_ratio), num(r.gap_bits)]
        cells += [f"{num(r.ratio_vs_fp16)}x", f"{num(r.ratio_vs_turbo3)}x", flag(r.exact)]
        cells += [num(r.max_abs_error), num(r.attention_error), residual_cell(r)]
        if continuation:
            agree = None if r.greedy_agreement is None else f"{100 * r.greedy_agreement:.0f}%"
            cells += [num(r.delta_log2_ppl), agree or "-"]
        table.add_row(*cells, style="dim" if r.role == "baseline" else None)
    return table


def summary_table(rows: list[Row]) -> Table:
    table = Table(title="where the bits go: bits per position by part, all sessions")
    cols = ["model", "codec", "sessions", "positions", *PARTS, "total", "gap (x)"]
    cols += ["marginal first → last window", "restore s", "restore tokens/s"]
    for col in cols:
        table.add_column(col, justify="left" if col in ("model", "codec") else "right")
    for s in by_codec(rows):
        first = [r.windows[0]["bits_per_position"] for r in s.rows if r.windows]
        last = [r.windows[-1]["bits_per_position"] for r in s.rows if r.windows]
        trend = f"{num(sum(first) / len(first))} → {num(sum(last) / len(last))}" if first else "-"
        table.add_row(
            escape(s.model),
            escape(codec_label(s.rows[0])),
            str(s.sessions),
            f"{s.positions:,}",
            *(num(s.part_bits_per_position(p)) for p in PARTS),
            num(s.bits_per_position),
            num(s.gap_ratio),
            trend,
            num(s.restore_seconds),
            num(s.restore_tokens_per_s),
            style="dim" if s.role == "baseline" else None,
        )
    return table


def residual_cell(row: Row) -> str:
    """Worst layer's 95th percentile of |residual|, K / V; "-" without a residual."""
    if row.residual_p95 is None:
        return "-"
    return f"{num(row.residual_p95_max('key'))} / {num(row.residual_p95_max('value'))}"


def codec_label(row: Row) -> str:
    """The codec id, with the file it comes from when it is a .skv input."""
    return f"{row.codec} [{Path(row.source).name}]" if row.source.endswith(".skv") else row.codec


def num(x: float | None) -> str:
    if x is None:
        return "-"
    if x == 0 or abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.3g}" if abs(x) < 1 else f"{x:.3f}" if abs(x) < 100 else f"{x:.1f}"


def flag(x: bool | None) -> str:
    return "-" if x is None else "yes" if x else "no"
