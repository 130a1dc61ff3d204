"""CI thresholds: which rows under test cross them, and why.

Gates judge the rows under test (`role == "subject"`): the sessions of each `.skv` input and
the codecs named with `--codecs`, or `seq` when neither is given. Baselines added by default
are there to compare with and are never gated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from seqkv_cli.errors import SeqkvError
from seqkv_cli.report.row import Row


@dataclass
class Thresholds:
    max_bits_per_position: float | None = None
    max_gap: float | None = None
    require_exact: bool = False

    def __post_init__(self) -> None:
        for flag, value in (
            ("--max-bits-per-position", self.max_bits_per_position),
            ("--max-gap", self.max_gap),
        ):
            if value is not None and not (math.isfinite(value) and value > 0):
                raise SeqkvError(f"{flag} must be a finite number > 0, got {value}")

    @property
    def active(self) -> bool:
        return (
            self.require_exact or self.max_bits_per_position is not None or self.max_gap is not None
        )

    def to_json(self) -> dict:
        return {
            "max_bits_per_position": self.max_bits_per_position,
            "max_gap": self.max_gap,
            "require_exact": self.require_exact,
        }


@dataclass
class Failure:
    id: str
    codec: str
    source: str
    reason: str

    def to_json(self) -> dict:
        return {"id": self.id, "codec": self.codec, "source": self.source, "reason": self.reason}


def check(rows: list[Row], limits: Thresholds) -> list[Failure]:
    """Every threshold crossed by a row under test; an empty list passes."""
    if not limits.active:
        return []
    subjects = [r for r in rows if r.role == "subject"]
    if not subjects:
        return [Failure("-", "-", "-", "no session under test to gate (no .skv, no seq row)")]
    failures = []
    for row in subjects:
        for reason in _reasons(row, limits):
            failures.append(Failure(row.id, row.codec, row.source, reason))
    return failures


def _reasons(row: Row, limits: Thresholds) -> list[str]:
    out = []
    bpp = row.bits_per_position
    if limits.max_bits_per_position is not None and not bpp <= limits.max_bits_per_position:
        out.append(f"bits/position {bpp:.3f} > {limits.max_bits_per_position:g}")
    if limits.max_gap is not None:
        gap = row.gap_ratio
        if gap is None:
            out.append("gap unknown (no log2 PP for this session)")
        elif not gap <= limits.max_gap:
            out.append(f"gap {gap:.3f} > {limits.max_gap:g}")
    if limits.require_exact and row.exact is not True:
        out.append(
            "not bit-exact"
            if row.exact is False
            else "exactness not verified (give its capture; do not pass --no-verify)"
        )
    return out


def summary(failures: list[Failure]) -> str:
    """One line naming every failing session, for the error message and job summaries."""
    parts = [f"{f.id} ({f.codec}): {f.reason}" for f in failures]
    return f"gate failed for {len({(f.id, f.codec, f.source) for f in failures})} row(s): " + (
        "; ".join(parts)
    )
