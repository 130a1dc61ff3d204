"""Per-codec totals over sessions: the summary table, the markdown summary and the plots."""

from __future__ import annotations

from dataclasses import dataclass

from seqkv_cli.report.row import Row


@dataclass
class CodecSummary:
    model: str
    codec: str
    source: str
    role: str
    rows: list[Row]

    @property
    def sessions(self) -> int:
        return len(self.rows)

    @property
    def positions(self) -> int:
        return sum(r.positions for r in self.rows)

    @property
    def bits_per_position(self) -> float:
        return sum(r.bits_total for r in self.rows) / max(self.positions, 1)

    @property
    def log2_ppl(self) -> float | None:
        """Mean surprisal over the scored positions of every session (n - 1 each)."""
        scored = [(r.log2_ppl, r.positions - 1) for r in self.rows if r.log2_ppl is not None]
        total = sum(n for _, n in scored)
        return sum(v * n for v, n in scored) / total if total else None

    @property
    def gap_ratio(self) -> float | None:
        ppl = self.log2_ppl
        return self.bits_per_position / ppl if ppl else None

    def part_bits_per_position(self, part: str) -> float:
        return sum(r.breakdown.get(part, 0.0) for r in self.rows) / max(self.positions, 1)

    @property
    def exact(self) -> bool | None:
        flags = [r.exact for r in self.rows]
        return None if None in flags else all(flags)

    @property
    def restore_seconds(self) -> float | None:
        """Wall time to restore every session (the last one out), when it was measured."""
        return self.worst("restore_seconds")

    @property
    def restore_tokens_per_s(self) -> float | None:
        seconds = self.restore_seconds
        return self.positions / seconds if seconds else None

    def worst(self, key: str) -> float | None:
        values = [getattr(r, key) for r in self.rows if getattr(r, key) is not None]
        return max(values) if values else None

    def mean(self, key: str) -> float | None:
        values = [getattr(r, key) for r in self.rows if getattr(r, key) is not None]
        return sum(values) / len(values) if values else None


def by_codec(rows: list[Row]) -> list[CodecSummary]:
    """One summary per (model, codec, source), in the order rows first name them."""
    out: dict[tuple[str, str, str], CodecSummary] = {}
    for row in rows:
        key = (row.model_fingerprint, row.codec, row.source)
        if key not in out:
            out[key] = CodecSummary(row.model, row.codec, row.source, row.role, [])
        out[key].rows.append(row)
    return list(out.values())
