"""The one Markdown table of every bench report: a header, its rule, a line a row."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def table(head: Sequence[str], rows: Iterable[Sequence[object]], align: str = "") -> list[str]:
    """The table's lines. Cells are shown as `str` gives them (format numbers before);
    `align` has a letter a column, "r" for a right-aligned one (`---:`), else left."""
    rule = ["---:" if align[i : i + 1] == "r" else "---" for i in range(len(head))]
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join(rule) + " |"]
    for row in rows:
        if len(row) != len(head):
            raise ValueError(f"a row of {len(row)} cells under {len(head)} columns")
        lines.append("| " + " | ".join(str(c) for c in row) + " |")
    return lines
