"""Restoring sessions of a flat archive (one set of sections per session; archive.restore.Archive).

A per-vector codec's K/V blocks decode one session at a time; a model codec's token streams
decode `batch` sessions in lockstep, one model pass per position for all of them. A damaged
session does not stop the others.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from seqkv_cli.archive.entries import checked_part
from seqkv_cli.container.layout import kv_part, section_name
from seqkv_cli.errors import SeqkvError
from seqkv_cli.kvcapture.capture_file import Capture

KINDS = ("key", "value")


def restore_flat(arc, entries: list[dict], batch: int) -> Iterator[tuple[dict, object]]:
    """Yield (entry, Capture or the SeqkvError that stopped it), in order, for `entries` of
    the flat archive `arc` (an open archive.restore.Archive)."""
    if not arc.needs_model:
        for entry in entries:
            try:
                result = _restore_pervector(arc, entry)
            except SeqkvError as exc:  # one damaged session does not stop the others
                result = exc
            yield entry, arc.with_meta(entry, result)
        return
    canon = arc.canonical()
    done, total = 0, sum(e["positions"] for e in entries)
    for start in range(0, len(entries), batch):
        chunk = entries[start : start + batch]
        group, reads, failed = [], [], {}
        for k, entry in enumerate(chunk):
            try:  # a session whose stream is unusable fails alone, before the batch runs
                read = _reader_for(arc, entry)
                arc.codec.screen_tokens(entry, read("tokens.seq"), canon)
                group.append(entry)
                reads.append(read)
            except SeqkvError as exc:
                failed[k] = exc
        results = iter(arc.codec.decode_many(group, reads, canon) if group else [])
        done += sum(e["positions"] for e in chunk)
        if arc.on_tokens is not None:
            arc.on_tokens(done, total)
        for k, entry in enumerate(chunk):
            result = failed[k] if k in failed else next(results)
            if isinstance(result, Exception):  # name the file and session
                result = SeqkvError(f"{arc.path}: session {entry['id']}: {result}")
            yield entry, arc.with_meta(entry, result)


def _reader_for(arc, entry: dict):
    i, owned = entry["index"], set(entry["sections"])
    if section_name(i, "tokens.seq") not in owned:
        raise SeqkvError(f"{arc.path}: session {entry['id']} has no token stream")

    def read(part: str) -> bytes | None:
        name = section_name(i, part)
        return checked_part(entry, part, arc.reader.read_section(name) if name in owned else None)

    return read


def _restore_pervector(arc, entry: dict):

    i, n = entry["index"], entry["positions"]
    raw_tokens = arc.reader.read_section(section_name(i, "tokens"))
    raw_surprisal = arc.reader.read_section(section_name(i, "surprisal"))
    if len(raw_tokens) != 4 * n or len(raw_surprisal) != 8 * max(n - 1, 0):
        raise SeqkvError(f"{arc.path}: session {entry['id']} has inconsistent lengths")
    tokens = np.frombuffer(raw_tokens, "<u4")
    surprisal = np.frombuffer(raw_surprisal, "<f8")
    # every K/V block the session owns is restored: a header claiming fewer layers than
    # the file holds would otherwise drop some silently
    layers = entry["shapes"]["num_layers"]
    want = {section_name(i, kv_part(k, kind)) for k in range(layers) for kind in KINDS}
    held = {name for name in entry["sections"] if "/layers." in name}
    if held != want:
        raise SeqkvError(
            f"{arc.path}: session {entry['id']} holds K/V blocks for other layers than "
            f"the {layers} its header says"
        )
    if tokens.shape[0] != n or surprisal.shape[0] != max(n - 1, 0):
        raise SeqkvError(f"{arc.path}: session {entry['id']} has inconsistent lengths")
    layers = range(entry["shapes"]["num_layers"])
    keys = [arc.decode_kv(entry, layer, "key") for layer in layers]
    values = [arc.decode_kv(entry, layer, "value") for layer in layers]
    meta = {"session_id": entry["id"], "dtype": entry["dtype"]}  # completed by with_meta
    return Capture(
        torch.from_numpy(tokens.astype(np.int64)),
        keys,
        values,
        torch.from_numpy(surprisal.copy()),
        meta,
    )
