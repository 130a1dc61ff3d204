"""`archive list`: per session, what it costs on its own and the prefix it shares."""

from __future__ import annotations

from pathlib import Path

from seqkv_cli.skv.accounting import account
from seqkv_cli.skv.restore import Archive
from seqkv_cli.trie import session_costs, trie_shape


def session_rows(path: Path) -> tuple[list[dict], str]:
    """Rows for `archive list` (flat archives list their sessions with no sharing)."""
    with Archive(path) as arc:
        if arc.trie is None:
            rows = [
                {**s, "own_bytes": s["bytes"], "shared_prefix": 0, "segment": 1}
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
