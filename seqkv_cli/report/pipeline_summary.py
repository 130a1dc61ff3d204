"""The numbers of `seqkv pipeline`'s summary: bits per token position of seq, of a per-vector
baseline and of fp16 K/V, per session and for the whole file, next to log2 PP.

`pipeline_summary` reads the seq container's accounting; `summarise` does the arithmetic on
plain values, so it can be checked without a model. The command formats the rows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

FILE_ROW = "all (file)"


@dataclass(frozen=True)
class SummaryRow:
    """One line of the summary: a session, or the whole file (``session`` == FILE_ROW).

    ``seq_bits`` and ``baseline_bits`` are bits per token position; ``fp16_bits`` is what fp16
    K/V takes per position; ``vs_fp16`` is fp16 / seq. ``residual_bytes`` and ``exact`` (None:
    not decoded) are per session only.
    """

    session: str
    tokens: int
    log2_ppl: float
    seq_bits: float
    baseline_bits: float
    fp16_bits: int
    vs_fp16: float
    residual_bytes: int | None = None
    exact: bool | None = None


@dataclass(frozen=True)
class PipelineSummary:
    sessions: list[SummaryRow]
    file: SummaryRow
    seq_file_bytes: int
    baseline_file_bytes: int
    captured_kv_bytes: int


def fp16_bits_per_position(num_layers: int, num_kv_heads: int, head_dim: int) -> int:
    """Bits of one position's K and V in fp16, over every layer and KV head."""
    return num_layers * num_kv_heads * head_dim * 2 * 16


def file_log2_ppl(captures: Sequence, total_positions: int) -> float:
    """Mean surprisal over every predicted token of the file (each session's first has none)."""
    surprisal = sum(float(c.surprisal.sum()) for c in captures)
    return surprisal / max(total_positions - len(captures), 1)


def summarise(
    captures: Sequence,
    entries: Sequence[Mapping],
    accounts: Sequence[Mapping],
    seq,
    base,
    fp16_bits: int,
    exact: Mapping[str, bool],
) -> PipelineSummary:
    """The summary from plain values.

    ``captures``: the captured sessions, in the container's order; ``entries`` and
    ``accounts``: the seq container's session entries and their accounting
    (`archive.listing.account(...).sessions`); ``seq``, ``base``: the `CompressResult` of the
    seq and the baseline containers; ``exact``: session id -> restored bit-exactly, for the
    sessions that were decoded.
    """
    base_bits = base.part_bytes["kv"] * 8 / base.positions
    rows = []
    for cap, entry, acc in zip(captures, entries, accounts, strict=True):
        bits = acc["bits_per_position"]
        rows.append(
            SummaryRow(
                session=cap.session_id,
                tokens=cap.positions,
                log2_ppl=cap.log2_ppl,
                seq_bits=bits,
                baseline_bits=base_bits,
                fp16_bits=fp16_bits,
                vs_fp16=fp16_bits / bits,
                residual_bytes=entry["residual_bytes"],
                exact=exact.get(cap.session_id),
            )
        )
    total = seq.positions
    file_row = SummaryRow(
        session=FILE_ROW,
        tokens=total,
        log2_ppl=file_log2_ppl(captures, total),
        seq_bits=seq.file_bytes * 8 / total,
        baseline_bits=base_bits,
        fp16_bits=fp16_bits,
        vs_fp16=fp16_bits * total / (seq.file_bytes * 8),
    )
    return PipelineSummary(rows, file_row, seq.file_bytes, base.file_bytes, seq.input_kv_bytes)


def pipeline_summary(lm, captures: Sequence, seq, base, exact: Mapping[str, bool]):
    """`summarise` for a pipeline run: reads the seq container at ``seq.path`` (model `lm`)."""
    from seqkv_cli.archive import Archive, account

    with Archive(seq.path, model=lm) as arc:
        entries, accounts = arc.sessions, account(arc).sessions
    fp16 = fp16_bits_per_position(lm.num_layers, lm.num_kv_heads, lm.head_dim)
    return summarise(captures, entries, accounts, seq, base, fp16, exact)
