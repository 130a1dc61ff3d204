"""Checks on what a container header says of a session, before anything is decoded.

Headers pass their CRC, but a file written by another tool may still lack fields or claim
sizes its parts cannot have: each is refused in one line here.
"""

from __future__ import annotations

from pathlib import Path

from seqkv_cli.errors import SeqkvError
from seqkv_cli.sequential.surprisal_part import plausible_surprisal_part
from seqkv_cli.trie import MAX_POSITIONS


def check_entry(path: Path, entry: object) -> None:
    """A session entry with every field restore needs, in range."""
    shapes = entry.get("shapes") if isinstance(entry, dict) else None
    ok = (
        isinstance(shapes, dict)
        and isinstance(entry.get("id"), str)
        and all(_int_in(entry.get(k), 0, 1 << 62) for k in ("index", "positions"))
        and entry.get("dtype") in ("bf16", "fp16", "fp32")
        and all(
            _int_in(shapes.get(k), 1, 0xFFFF) for k in ("num_layers", "num_kv_heads", "head_dim")
        )
        and isinstance(entry.get("sections", []), list)
        and all(isinstance(name, str) for name in entry.get("sections", []))
        and isinstance(entry.get("capture_meta", {}), dict)
    )
    if not ok:
        raise SeqkvError(f"{path}: malformed session entry in the header: {str(entry)[:80]!r}")
    if entry["positions"] > MAX_POSITIONS:  # bounds every allocation sized by positions
        raise SeqkvError(
            f"{path}: session {entry['id']!r} claims {entry['positions']} positions, "
            f"over the limit of {MAX_POSITIONS}"
        )


def checked_part(entry: dict, part: str, data: bytes | None) -> bytes | None:
    """A session's own part, refused when its size cannot be what the entry says."""
    if part == "surprisal" and data is not None:
        want = max(entry["positions"] - 1, 0)
        if not plausible_surprisal_part(data, want):  # raw float64, or SKS1 and shorter
            raise SeqkvError(f"its stored surprisal holds {len(data)} bytes, not {8 * want}")
    return data


def _int_in(value, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high
