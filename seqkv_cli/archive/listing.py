"""What an archive holds and who pays for it: `seqkv info`'s accounting and `archive list`'s rows.

`account` says where a container's bytes go, per session, per part and per position (a trie
archive's shared nodes split among the sessions that cover them, `trie.session_costs`);
`session_rows` lists every session with what it costs on its own, the prefix it shares and
how its K/V come back (`restore_kind`), for `archive list` and the library's `sessions()`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from seqkv_cli.archive.replay import entry_record
from seqkv_cli.archive.restore import Archive
from seqkv_cli.errors import SeqkvError
from seqkv_cli.trie import session_costs, trie_shape


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
    tail = name.split("/")[-1]
    if tail == "index" and name.startswith("t"):
        return "trie tables"
    if tail.startswith("layers."):
        return "keys" if tail.endswith(".key") else "values"
    if tail.startswith("residual."):
        return "residual"
    return "tokens" if tail == "tokens.seq" else tail  # tokens, surprisal, ...


def _breakdown(entry: dict, sizes: dict[str, int], header_share: float) -> dict[str, float]:
    """Bytes of one session by kind: its own sections plus its share of the header/index."""
    out = {"tokens": 0.0, "residual": 0.0, "kv": 0.0, "header": header_share, "trie": 0.0}
    for name in entry["sections"]:
        part = _part(name)
        key = (
            part if part in ("tokens", "residual") else "kv" if part in ("keys", "values") else None
        )
        out[key or "header"] += sizes[name]
    return out


def account(archive: Archive) -> Accounting:
    reader = archive.reader
    sizes = {e.name: e.length for e in reader.sections}
    parts: dict[str, int] = {}
    for name, length in sizes.items():
        parts[_part(name)] = parts.get(_part(name), 0) + length
    # a version-2 segment table is followed by its segment's tokens in the same section
    trie = getattr(archive, "trie", None)
    embedded = sum(len(t) for t in trie.embedded.values()) if trie is not None else 0
    if embedded:
        parts["trie tables"] -= embedded
        parts["tokens"] = parts.get("tokens", 0) + embedded
    parts["header + index"] = reader.size - sum(sizes.values())
    # The header and index serve every session: each carries its share by positions.
    total_positions = max(sum(e["positions"] for e in archive.sessions), 1)
    sessions, positions = [], 0
    trie_costs = None
    if getattr(archive, "trie", None) is not None:
        from seqkv_cli.trie import session_costs

        trie_costs = session_costs(archive)
    for i, entry in enumerate(archive.sessions):
        n = sum(sizes[s] for s in entry["sections"])
        share = parts["header + index"] * entry["positions"] / total_positions
        breakdown = _breakdown(entry, sizes, share)
        if trie_costs is not None:
            # Trie tables and the file header are shared equally; tokens split by coverage.
            cost = trie_costs[i]
            breakdown = {
                "tokens": cost["tokens"],
                "residual": cost["residual"],
                "kv": cost["kv"],
                "header": cost["header"],
                "trie": cost["trie"],
            }
            n = cost["tokens"] + cost["kv"] + cost["trie"] + cost["residual"]
        sessions.append(
            {
                "id": entry["id"],
                "positions": entry["positions"],
                "dtype": entry["dtype"],
                "bytes": n,
                "bits_per_position": n * 8 / max(entry["positions"], 1),
                "log2_ppl": entry.get("log2_ppl"),
                "breakdown": breakdown,
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


def restore_kind(entry: dict) -> str:
    """How a session's K/V come back: "replay", "canonical + residual", "canonical", or
    "malformed replay record" (one bad record must not hide the other sessions)."""
    try:
        if entry_record(entry) is not None:
            return "replay"
    except SeqkvError:
        return "malformed replay record"
    return "canonical + residual" if entry.get("residual_bytes") else "canonical"


def session_rows(path: Path) -> tuple[list[dict], str]:
    """Rows for `archive list` and `sessions()` (flat archives list their sessions with no
    sharing): id, positions, own bytes, shared prefix, segment, load mode, restore kind."""
    with Archive(path) as arc:
        if arc.trie is None:
            mode = arc.load_mode({})
            kinds = {e["id"]: restore_kind(e) for e in arc.sessions}
            rows = [
                {
                    **s,
                    "own_bytes": s["bytes"],
                    "shared_prefix": 0,
                    "segment": 1,
                    "load": mode,
                    "restore": kinds[s["id"]],
                }
                for s in account(arc).sessions
            ]
            return rows, "flat layout: sessions share nothing (`seqkv archive compact` converts)"
        costs = session_costs(arc)
        rows = [
            {
                "id": e["id"],
                "positions": e["positions"],
                "own_bytes": c["tokens"] + c["kv"] + c["residual"],
                "shared_prefix": c["shared_prefix"],
                "segment": e["trie"]["segment"],
                "log2_ppl": e.get("log2_ppl"),
                "load": arc.load_mode(e),
                "restore": restore_kind(e),
            }
            for e, c in zip(arc.sessions, costs, strict=True)
        ]
        shape = trie_shape(arc)
        note = (
            f"{shape['nodes']} nodes in {shape['segments']} segment(s), depth {shape['depth']}; "
            f"{shape['coverage']:.0%} of sessions share a prefix with another; dedup saves "
            f"{shape['saved_bytes']:,.0f} bytes"
        )
        return rows, note
