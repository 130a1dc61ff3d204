"""Questions `open_archive`'s archive answers from the file's index alone (no token is
decoded): the sessions it holds, one session's entry, its user metadata, its replay schedule."""

from __future__ import annotations

from pathlib import Path

from seqkv_cli.api.results import SessionInfo
from seqkv_cli.errors import SeqkvError


def capture_meta(entry: dict) -> dict:
    """An index entry's capture metadata with its session id (what a replay record is read
    against)."""
    return {**entry.get("capture_meta", {}), "session_id": entry["id"]}


def session_infos(path: Path) -> list[SessionInfo]:
    """Every session of the archive at `path`: id, tokens, bytes of its own, positions shared
    with others, and how `load` rebuilds its K/V."""
    from seqkv_cli.api.replay import read_record
    from seqkv_cli.archive.summary import session_rows
    from seqkv_cli.skv.restore import Archive

    rows, _ = session_rows(path)
    with Archive(path) as arc:
        entries = {e["id"]: e for e in arc.sessions}
    out = []
    for r in rows:
        entry = entries[r["id"]]
        try:
            replayed = read_record(capture_meta(entry), int(entry["positions"])) is not None
        except SeqkvError:  # one bad record must not hide the other sessions
            replayed, how = False, "malformed replay record"
        else:
            how = "canonical + residual" if entry.get("residual_bytes") else "canonical"
        if replayed:
            how = "replay"
        out.append(
            SessionInfo(
                r["id"], int(r["positions"]), int(r["own_bytes"]), int(r["shared_prefix"]), how
            )
        )
    return out


def index_entry(path: Path, session_id: str) -> dict:
    """One session's index entry (a one-line error for an id the archive does not hold)."""
    from seqkv_cli.skv.restore import Archive

    with Archive(path) as arc:
        return arc.session(str(session_id))


def replay_schedule(entry: dict) -> list[int] | None:
    """The forward calls (token counts) that filled a replayed session's cache; None for a
    session without a replay record."""
    from seqkv_cli.api.replay import Schedule, read_record

    rec = read_record(capture_meta(entry), int(entry["positions"]))
    return None if rec is None else list(Schedule.from_runs(rec["calls"]).calls)
