"""Restoring sessions of a trie archive (skv.restore.Archive's trie path).

Only the nodes on the asked sessions' paths are decoded (trie.decode for model codecs,
trie.pervector otherwise). Two kinds of session need another session restored first: a
near-duplicate member needs its centroid's tokens, and a session whose residual rests on an
earlier one (skv/residual_on_other_session.py) needs that session's K/V. Those are restored
too, and yielded only if they were asked for.
"""

from __future__ import annotations

from collections.abc import Iterator

from seqkv_cli.errors import SeqkvError
from seqkv_cli.skv.session_entries import checked_part
from seqkv_cli.trie import (
    DecodeStats,
    NodeSource,
    decode_sessions,
    ppl_milli,
    restore_member,
    restore_pervector,
    session_part,
)


def restore_trie(arc, entries: list[dict]) -> Iterator[tuple[dict, object]]:
    """Yield (entry, Capture or the SeqkvError that stopped it) for `entries` of the trie
    archive `arc` (an open skv.restore.Archive), as they finish."""
    wanted = {e["index"]: e for e in entries}
    members = {i: e for i, e in wanted.items() if e["trie"].get("centroid") is not None}
    base = {i: e for i, e in wanted.items() if i not in members}
    for e in members.values():
        c = e["trie"]["centroid"]
        base.setdefault(c, arc.sessions[c])
        if arc.sessions[c]["trie"].get("centroid") is not None:
            raise SeqkvError(f"{arc.path}: session {e['id']}'s centroid is itself an edit")
    based, broken = _residual_bases(arc, base)
    for i, exc in broken.items():  # a damaged session fails alone
        base.pop(i)
        if i in wanted:
            yield wanted[i], exc
    for b in set(based.values()):
        base.setdefault(b, arc.sessions[b])
    centroid_tokens = {}
    finished, held = {}, {}
    for entry, result in _restore_paths(arc, base):
        i = entry["index"]
        if not isinstance(result, Exception):
            centroid_tokens[i] = result.tokens.numpy()
            if result.deferred and i not in based:
                result = SeqkvError(
                    f"{arc.path}: session {entry['id']}: a residual rests on a session "
                    "its parts do not name: the file is damaged"
                )
        if i in based.values():
            finished[i] = result
        held[i] = (entry, result)
        for j in [j for j in held if j not in based or based[j] in finished]:
            e, r = held.pop(j)
            if j in based:
                r = _rest_on(arc, e, r, finished[based[j]])
            if j in wanted:
                yield e, arc.with_meta(e, r)
    for entry in members.values():
        c = entry["trie"]["centroid"]
        if c not in centroid_tokens:
            result = SeqkvError(f"{arc.path}: session {entry['id']}: its centroid failed")
        else:
            result = _restore_member(arc, entry, centroid_tokens[c])
        yield entry, arc.with_meta(entry, result)


def _residual_bases(arc, entries: dict[int, dict]):
    """{session index: the session its residual rests on} for these path sessions, and
    {session index: error} for those whose parts are damaged."""
    from seqkv_cli.skv.residual_on_other_session import residual_base

    out, broken = {}, {}
    for i, e in entries.items():
        try:
            b = residual_base(e, _session_reader(arc, e))
            if b is not None and (
                not 0 <= b < len(arc.sessions)
                or arc.sessions[b]["trie"].get("centroid") is not None
                or residual_base(arc.sessions[b], _session_reader(arc, arc.sessions[b])) is not None
            ):
                raise SeqkvError("the session its residual rests on is not a plain one")
        except SeqkvError as exc:
            broken[i] = SeqkvError(f"{arc.path}: session {e['id']}: {exc}")
            continue
        if b is not None:
            out[i] = b
    return out, broken


def _rest_on(arc, entry: dict, result, base):
    from seqkv_cli.skv.residual_on_other_session import rest_on

    if isinstance(result, Exception):
        return result
    if isinstance(base, Exception):
        return SeqkvError(
            f"{arc.path}: session {entry['id']}: the session its residual rests on failed ({base})"
        )
    try:
        return rest_on(result, base)
    except SeqkvError as exc:
        return SeqkvError(f"{arc.path}: session {entry['id']}: {exc}")


def _restore_member(arc, entry: dict, centroid_tokens):
    from seqkv_cli.sequential.session_codec import finish_capture

    try:
        read = _session_reader(arc, entry)
        return restore_member(entry, read, centroid_tokens, arc.canonical(), finish_capture)
    except SeqkvError as exc:
        return SeqkvError(f"{arc.path}: session {entry['id']}: {exc}")


def _restore_paths(arc, by_index: dict[int, dict]):
    reads = {i: _session_reader(arc, e) for i, e in by_index.items()}
    if arc.needs_model:
        canon = arc.canonical()
        precision = getattr(arc.codec, "precision_bits", 24)
        source = NodeSource(arc.trie, arc.read_part, canon.vocab_size, precision)
        stats = arc.decode_stats = DecodeStats(on_tokens=arc.on_tokens)
        results = decode_sessions(
            arc.trie, list(by_index), source, arc.codec, canon, by_index, reads, stats
        )
    else:
        results = restore_pervector(arc, list(by_index), reads)
    for s, result in results:
        entry = by_index[s]
        stored = arc.trie.sessions[s].log2_ppl_milli
        if not isinstance(result, Exception) and ppl_milli(result.surprisal) != stored:
            # the session table's log2 PP is the one redundant record of a session's
            # length and path: a changed end or end node shows up here
            result = SeqkvError(
                f"its restored log2 PP ({ppl_milli(result.surprisal) / 1000:.3f}) is not "
                f"the one its table records ({stored / 1000:.3f}): the archive is damaged"
            )
        if isinstance(result, Exception):
            result = SeqkvError(f"{arc.path}: session {entry['id']}: {result}")
        yield entry, result


def _session_reader(arc, entry: dict):
    """A reader of the trie session's own parts (residuals, surprisal), checked."""
    where = entry["trie"]
    owned = set(entry["sections"])

    def read(part: str) -> bytes | None:
        name = session_part(where["segment"], where["local"], part)
        return checked_part(entry, part, arc.reader.read_section(name) if name in owned else None)

    return read
