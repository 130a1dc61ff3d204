"""Where a container's bytes go: per session, per part, per position."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Accounting:
    file_bytes: int
    positions: int
    parts: dict[str, int]
    sessions: list[dict] = field(default_factory=list)
    fp16_bits_per_position: int = 0

    @property
    def log2_ppl(self) -> float | None:
        """Mean surprisal over the scored positions of all sessions (None if unknown)."""
        scored = [(s["log2_ppl"], s["positions"] - 1) for s in self.sessions if s["log2_ppl"]]
        total = sum(n for _, n in scored)
        return sum(v * n for v, n in scored) / total if total else None

    @property
    def bits_per_position(self) -> float:
        return self.file_bytes * 8 / max(self.positions, 1)


def _part(name: str) -> str:
    tail = name.split("/", 1)[-1]
    if tail.startswith("layers."):
        return "keys" if tail.endswith(".key") else "values"
    if tail.startswith("residual."):
        return "residual"
    return "tokens" if tail == "tokens.seq" else tail  # tokens, surprisal, ...


def account(archive) -> Accounting:
    reader = archive.reader
    sizes = {e.name: e.length for e in reader.sections}
    parts: dict[str, int] = {}
    for name, length in sizes.items():
        parts[_part(name)] = parts.get(_part(name), 0) + length
    parts["header + index"] = reader.size - sum(sizes.values())
    sessions, positions = [], 0
    for entry in archive.sessions:
        n = sum(sizes[s] for s in entry["sections"])
        sessions.append(
            {
                "id": entry["id"],
                "positions": entry["positions"],
                "dtype": entry["dtype"],
                "bytes": n,
                "bits_per_position": n * 8 / max(entry["positions"], 1),
                "log2_ppl": entry.get("log2_ppl"),
            }
        )
        positions += entry["positions"]
    shapes = archive.sessions[0]["shapes"] if archive.sessions else {}
    fp16 = (
        2
        * 16
        * shapes.get("num_layers", 0)
        * shapes.get("num_kv_heads", 0)
        * shapes.get("head_dim", 0)
    )
    return Accounting(reader.size, positions, parts, sessions, fp16)
