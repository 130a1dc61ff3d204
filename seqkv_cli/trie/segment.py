"""One segment of a trie archive: the first (compress) or one more (`archive add`).

A segment is what one commit adds: new nodes (branching off any earlier node, which is never
rewritten), the sessions that end in them, and their parts (tables.py, store.py). `place_sessions`
puts new sessions in the trie, `build_segment` codes them (encode.py for model codecs,
pervector.py otherwise), `grow_segment` does both on top of an archived trie, and
`segment_sections` names the parts as container sections. Writing the file, or appending the
sections to one, is the archive's job.

On top of an archived `seq` trie nothing is decoded: each new session is prefilled once, its
place found by the oracle (oracle.py) under its own rows, and only its tail coded.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import TYPE_CHECKING

import numpy as np

from seqkv_cli.errors import SeqkvError
from seqkv_cli.kvcapture.capture_file import DTYPES
from seqkv_cli.sequential.adapter import CanonicalLogits
from seqkv_cli.sequential.registry import capabilities
from seqkv_cli.trie.encode import (
    SegmentBuild,
    check_session,
    encode_model_segment,
    refuse_empty,
    session_records,
    static_tokens,
)
from seqkv_cli.trie.node_source import NodeSource
from seqkv_cli.trie.oracle import NodeOracle, RowStream, WarmStates, match
from seqkv_cli.trie.pervector import encode_pervector_segment, node_blocks, surprisal_offsets
from seqkv_cli.trie.plan import PlanNode, Trie, insertion_order
from seqkv_cli.trie.sources import Source
from seqkv_cli.trie.store import TrieContents, part_name
from seqkv_cli.trie.tables import Node, TableContext, encode_tables, is_version_2
from seqkv_codecs.sequential.node_stream import encode_node, intervals, token_check, verify_node
from seqkv_codecs.sequential.probability import intervals_from_logits
from seqkv_codecs.sequential.token_coder import uniform_row

if TYPE_CHECKING:
    from seqkv_cli.runtime.forward import CanonicalForward
    from seqkv_cli.sequential.session_codec import SessionCodec
    from seqkv_codecs.base import Codec


def place_sessions(
    trie: Trie,
    sources: list[Source],
    members: dict[int, int] | None = None,
    merge_prefixes: bool = False,
) -> list[tuple[int, int]]:
    """Insert every session (shortest first; longest first with `merge_prefixes`, see
    `insertion_order`); each one's (end node, end offset).

    Near-duplicate `members` (stored as edits) are not inserted: their path is only the
    prefix they share exactly; one that shares nothing is inserted after all (and dropped
    from `members`).
    """
    refuse_empty(sources)
    members = {} if members is None else members
    ends: list[tuple[int, int] | None] = [None] * len(sources)
    for i in insertion_order([len(s.tokens) for s in sources], merge_prefixes):
        if i not in members:
            node, end, _ = trie.insert(sources[i].tokens, i)
            ends[i] = (node, end)
    for i in sorted(members):
        node, offset, matched = trie.longest_match(sources[i].tokens)
        if matched == 0:
            del members[i]
            node, end, _ = trie.insert(sources[i].tokens, i)
            ends[i] = (node, end)
        else:
            ends[i] = trie.normalise(node, offset)
    return ends


def build_segment(
    trie: Trie,
    first_new: int,
    sources: list[Source],
    ends: list[tuple[int, int]],
    coder: SessionCodec | Codec,
    canon: CanonicalForward,
    on_progress: Callable[[int], None] | None,
    archived: Callable | None = None,
    members: dict[int, int] | None = None,
    on_session: Callable | None = None,
    context: TableContext | None = None,
    packed: bool = True,
) -> SegmentBuild:
    """The new nodes' parts and tables, coded by `coder`: under the model (`canon`) for a
    model codec, per-vector blocks otherwise (`archived(n)`: an archived node's K/V that a
    new path extends). `first_new`: the first new node's number. `context`: the archive the
    tables are written against (version 2), None for a version-1 table (an older file).
    `packed`: a model-free token stream may be packed ids (a file of format 1.7)."""
    if capabilities(coder).needs_canonical:
        refuse_out_of_vocab(sources, canon.vocab_size)
        build = encode_model_segment(
            trie, first_new, sources, ends, coder, canon, on_progress, members or {}, on_session
        )
    else:
        build = encode_pervector_segment(
            trie, first_new, sources, ends, coder, on_progress, archived
        )
    if packed:
        build.pack_ids_if_smaller()
    build.parts["index"] = encode_tables(build.tables, first_new, context)
    return build


def grow_segment(
    contents: TrieContents,
    source: NodeSource,
    sources: list[Source],
    coder: SessionCodec | Codec,
    canon: CanonicalForward,
    versioned: bool = True,
    archive_codec: SessionCodec | Codec | None = None,
    packed: bool = True,
    warm: WarmStates | None = None,
) -> SegmentBuild:
    """One more segment holding `sources`, on top of the archived trie `contents` (its node
    tokens read through `source`; `canon` is None for per-vector codecs): nothing archived is
    decoded where it was coded under the model, per-vector blocks only where a new path needs
    them. `versioned`: its tables are version 2, written against the archive (false for a
    file older than 1.6). `coder` codes the new segment; where it is not the archive's own
    (`archive_codec`, a file of format 1.7), the segment's table names it. `packed`: a
    model-free token stream may be packed ids (a file of format 1.7). `warm`: the state of
    the session this process appended last, which a new session extending it continues
    (then kept for the next append)."""
    context = contents.context if versioned else None
    first_new = len(contents.nodes)
    base = coder if archive_codec is None else archive_codec
    steps = _stepped_nodes(contents, base)
    trie = Trie()
    for n, node in enumerate(contents.nodes):
        known = None if steps[n] else source.tokens(n)
        trie.add(PlanNode(node.parent, node.attach, node.start, known, -1, node.n_tokens))
    # a caller that keeps states (the library API) takes the path that forks and keeps them
    if any(steps) or capabilities(coder).steps_model or (warm is not None and canon is not None):
        places = {r.id: (r.end_node, r.end) for r in contents.sessions}
        build = _extend(trie, sources, coder, canon, source, warm, places)
        if packed:
            build.pack_ids_if_smaller()
        if coder is not base and build.tables.nodes:  # no new tokens: nothing to name
            build.tables.codec = coder.codec_id
        build.parts["index"] = encode_tables(build.tables, first_new, context)
        return build
    if coder is not base:
        raise SeqkvError("internal: a segment of another codec on a trie of known tokens")
    ends = place_sessions(trie, sources)
    archived = _archived_kv(contents, source, coder)
    return build_segment(
        trie, first_new, sources, ends, coder, canon, None, archived, context=context, packed=packed
    )


def _stepped_nodes(contents: TrieContents, base) -> list[bool]:
    """Per archived node: whether its tokens are only known by decoding it under the model."""
    if not capabilities(base).needs_canonical:
        return [False] * len(contents.nodes)
    from seqkv_cli.trie.decode import node_steps

    return node_steps(contents, base)


def segment_sections(build: SegmentBuild, segment: int) -> list[tuple[str, bytes]]:
    """The segment's parts as container sections, index first (empty parts are left out)."""
    parts = dict(build.parts)
    sections = index_sections(segment, parts.pop("index"), parts.pop("tokens", b""))
    return sections + [(part_name(segment, n), parts[n]) for n in sorted(parts) if parts[n]]


def index_sections(segment: int, index: bytes, tokens: bytes) -> list[tuple[str, bytes]]:
    """A segment's table and token stream as sections: one `t<k>/index` holding both after a
    version-2 table (a section of its own costs ~14 bytes of index record), else the table
    and, unless empty, `t<k>/tokens`."""
    if is_version_2(index):
        return [(part_name(segment, "index"), index + tokens)]
    out = [(part_name(segment, "index"), index)]
    return out + ([(part_name(segment, "tokens"), tokens)] if tokens else [])


def refuse_out_of_vocab(sources: list[Source], vocab: int) -> None:
    """The model embeds only ids below its vocabulary; refuse others before any model work."""
    for src in sources:
        if len(src.tokens) and (src.tokens.min() < 0 or src.tokens.max() >= vocab):
            raise SeqkvError(
                f"session {src.session_id}: token ids must lie in [0, {vocab}) for this model, "
                f"got {src.tokens.min()}..{src.tokens.max()}"
            )


def _archived_kv(contents: TrieContents, source: NodeSource, coder) -> Callable | None:
    """Per-vector codecs: decode an archived node's K/V blocks when a new path needs them."""
    if capabilities(coder).needs_canonical:
        return None
    view = SimpleNamespace(trie=contents, read_part=source.read_part, codec=coder)
    offsets = surprisal_offsets(contents)

    def archived(n: int):
        profile = next(iter(contents.profiles.values()))
        entry = {"shapes": profile["shapes"], "dtype": profile["dtype"]}
        _, keys, values, surprisal = node_blocks(view, source, n, offsets, entry)
        return keys, values, surprisal

    return archived


def _extend(
    trie: Trie,
    sources: list[Source],
    coder,
    canon: CanonicalForward,
    source: NodeSource,
    warm: WarmStates | None = None,
    places: dict[str, tuple[int, int]] | None = None,
) -> SegmentBuild:
    """Each session: one prefill, matched against the trie by the oracle (nodes of known
    tokens compare directly), its tail coded: under its own rows (`seq`), or with the other
    tails under one static table (`seq-fast`). A session that extends the archived one whose
    state `warm` holds (at `places[id]` = its end node and offset) runs only what follows."""
    build = SegmentBuild(session_records(sources, [(0, 0)] * len(sources)))
    adapter = CanonicalLogits(canon)
    oracle = NodeOracle(source, coder.precision_bits)
    stepping = capabilities(coder).steps_model
    payloads, tails = [], []
    for local, src in enumerate(sources):
        hit = warm.take(src.tokens, canon) if warm is not None else None
        place = (places or {}).get(hit[0]) if hit is not None else None
        if place is not None:
            rows = RowStream(adapter, src.tokens, hit[1])
            start = (*place, hit[1].fed)
            node, k, matched = match(trie, src.tokens, oracle, rows, start)
        else:
            rows = RowStream(adapter, src.tokens)
            node, k, matched = match(trie, src.tokens, oracle, rows)
        if matched == len(src.tokens):
            end_node, end = trie.normalise(node, k)
        else:
            parent, attach = trie.normalise(node, k)
            tail = src.tokens[matched:].copy()
            payload = b""
            if stepping:
                payload, bits = _encode_tail(rows, src.tokens, matched, coder.precision_bits)
                payloads.append(payload)
                build.token_bits_ideal += bits
            else:
                tails.append(tail)
            end_node = trie.add(PlanNode(parent, attach, matched, tail, local))
            end = len(tail)
            build.tables.nodes.append(
                Node(parent, attach, len(tail), len(payload), token_check(tail))
            )
        record = build.tables.sessions[local]
        record.end_node, record.end = end_node, end
        track = rows.finish()
        keys, values = track.kv(canon.num_layers, DTYPES[src.meta["dtype"]])
        cap = src.recomputed(keys, values, track.surprisal) if src.recompute else src.load()
        if warm is not None:
            warm.keep(src.session_id, src.tokens, track, canon)
        check_session(
            src.coder_for(coder),
            build,
            local,
            cap,
            keys,
            values,
            track.surprisal,
            unrounded=track.unrounded,
        )
        adapter.tracks.clear()
    if stepping:
        build.parts["tokens"] = b"".join(payloads)
    else:
        build.parts["tokens"] = static_tokens(tails, canon.vocab_size, build)
    return build


def _encode_tail(
    rows: RowStream, tokens: np.ndarray, start: int, precision: int
) -> tuple[bytes, float]:
    """Range-code tokens[start:] under the session's own rows; self-checked before use."""
    lows, freqs, p, n = [], [], start, len(tokens)
    if p == 0:
        lo, fr = intervals(uniform_row(rows.adapter.vocab_size, precision)[None], tokens[:1])
        lows.append(lo)
        freqs.append(fr)
        p = 1
    while p < n:
        block = rows.rows_from(p)[: n - p]
        lo, fr = intervals_from_logits(block, tokens[p : p + len(block)], precision)
        lows.append(lo)
        freqs.append(fr)
        p += len(block)
    low, freq = np.concatenate(lows), np.concatenate(freqs)
    payload = encode_node(low, freq, precision)
    verify_node(payload, low, freq, precision)
    return payload, float((precision - np.log2(freq.astype(np.float64))).sum())
