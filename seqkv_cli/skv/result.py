"""What `compress` reports: sessions, positions and where the bytes went."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class CompressResult:
    path: Path
    sessions: int = 0
    positions: int = 0
    input_kv_bytes: int = 0
    file_bytes: int = 0
    part_bytes: dict[str, int] = field(default_factory=dict)
    layout: str = "flat"  # "flat", "trie" or "compact" (docs/FORMAT.md)
