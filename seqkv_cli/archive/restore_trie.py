"""Restoring sessions of a trie archive (archive.restore.Archive's trie path).

Only the nodes on the asked sessions' paths are decoded (trie.decode for model codecs,
trie.pervector otherwise). Two kinds of session need another session restored first: a
near-duplicate member needs its centroid's tokens, and a session whose residual rests on an
earlier one (archive/restore_trie.py) needs that session's K/V. Those are restored
too, and yielded only if they were asked for.

Residuals that rest on another session of the same segment (`SKB1` parts): for a session
whose first p positions have the same K/V bits as an earlier session of its segment
(llama.cpp slots sharing a system prompt), the encoder may code its residual against that
session's restored K/V for [0, p) and the recompute after it (trie/encode.py). Restore decodes
both sessions' token paths as usual, then applies such parts once the base session is
finished (`residual_base`, `rest_on`). A base never rests on another session itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import numpy as np
import torch

from seqkv_cli.archive.entries import checked_part
from seqkv_cli.errors import SeqkvError
from seqkv_cli.kvcapture.capture_file import DTYPE_NAMES
from seqkv_cli.sequential.session_codec import finish_capture, kv_bits, kv_from_bits, residual_p95
from seqkv_cli.trie import (
    DecodeStats,
    NodeSource,
    decode_sessions,
    ppl_milli,
    restore_member,
    restore_pervector,
    session_part,
)
from seqkv_codecs.errors import CodecError
from seqkv_codecs.residual import BASED_MAGIC, apply_residual, parse_based
from seqkv_codecs.rounding_residual import apply_rounding_residual

if TYPE_CHECKING:
    from seqkv_cli.kvcapture.capture_file import Capture


def restore_trie(arc, entries: list[dict]) -> Iterator[tuple[dict, object]]:
    """Yield (entry, Capture or the SeqkvError that stopped it) for `entries` of the trie
    archive `arc` (an open archive.restore.Archive), as they finish."""
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


def residual_base(entry: dict, read: Callable[[str], bytes | None]) -> int | None:
    """The global index of the session `entry`'s residual rests on, or None (the parts'
    headers are read; every based part must name the same earlier session)."""
    found = set()
    for layer in range(int(entry["shapes"]["num_layers"])):
        for kind in ("key", "value"):
            data = read(f"residual.layers.{layer}.{kind}")
            if data is None or data[:4] != BASED_MAGIC:
                continue
            try:
                found.add(parse_based(data)[0])
            except CodecError as exc:
                raise SeqkvError(f"residual.layers.{layer}.{kind}: {exc}") from None
    if not found:
        return None
    local = int(entry["trie"]["local"])
    if len(found) > 1 or min(found) >= local:
        raise SeqkvError(
            f"its residual rests on sessions {sorted(found)} of its segment; one earlier "
            "session is allowed: the file is damaged"
        )
    return int(entry["index"]) - local + found.pop()


def rest_on(cap: Capture, base: Capture) -> object:
    """`cap` with its deferred residual parts applied on `base`'s K/V for their positions."""
    for (kind, layer), (_, positions, inner, tail) in sorted(cap.deferred.items()):
        mine = (cap.keys if kind == "key" else cap.values)[layer]
        theirs = (base.keys if kind == "key" else base.values)[layer]
        if (
            theirs.dtype != mine.dtype
            or theirs.shape[0] != mine.shape[0]
            or theirs.shape[2] != mine.shape[2]
            or not 0 < positions <= min(mine.shape[1], theirs.shape[1])
        ):
            raise SeqkvError(
                f"residual.layers.{layer}.{kind} rests on {positions} positions of a session "
                f"of another shape ({tuple(theirs.shape)} vs {tuple(mine.shape)})"
            )
        reference = torch.cat([theirs[:, :positions], mine[:, positions:]], dim=1)
        try:
            if tail is None:
                bits = apply_residual(inner, kv_bits(reference))
            else:
                bits = _apply_rounding(inner, theirs[:, :positions], tail, mine.dtype)
        except CodecError as exc:
            raise SeqkvError(f"residual.layers.{layer}.{kind}: {exc}") from None
        restored = kv_from_bits(np.ascontiguousarray(bits), mine.dtype)
        (cap.keys if kind == "key" else cap.values)[layer] = restored
        if cap.residual_p95 is not None:  # the residual is against the base where it rests
            cap.residual_p95[kind][layer] = residual_p95(reference, restored)
    cap.deferred = {}
    return cap


def _apply_rounding(inner: bytes, shared: torch.Tensor, tail: torch.Tensor, dtype) -> np.ndarray:
    """An SKR2 stream against the base's K/V (exact in float32, so their rounding is the same
    bits) for the shared positions and this session's unrounded recompute after them."""
    if tail.shape[0::2] != shared.shape[0::2]:
        raise SeqkvError("the recompute after a shared prefix has another shape")
    reference = torch.cat([shared.float(), tail.float()], dim=1).contiguous()
    return apply_rounding_residual(inner, reference.numpy(), DTYPE_NAMES[dtype])
