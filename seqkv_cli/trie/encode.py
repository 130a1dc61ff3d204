"""Encoding one trie segment for the model-backed codecs (`seq`, `seq-fast`).

The walk runs the model once per node, from a fork of its parent's state: a shared prefix is
computed once however many sessions share it. `seq` codes each new node's tokens under the
rows that walk produces; `seq-fast` codes all new tokens of the segment with one static rANS
table. A session's residual compares its captured K/V with what the trie reproduces.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from seqkv_cli.errors import SeqkvError
from seqkv_cli.kvcapture.capture_file import DTYPE_NAMES, DTYPES
from seqkv_cli.sequential.adapter import CanonicalLogits, unrounded_kv
from seqkv_cli.sequential.registry import capabilities
from seqkv_cli.sequential.session_codec import EncodedSession, kv_bits
from seqkv_cli.sequential.surprisal_part import encode_surprisal_part
from seqkv_cli.trie.plan import Trie
from seqkv_cli.trie.runs import Run, prefill, session_kv, start_run
from seqkv_cli.trie.sources import Source, ppl_milli, profiles_for
from seqkv_cli.trie.tables import Node, SegmentTables, SessionRecord

if TYPE_CHECKING:
    from seqkv_cli.runtime.forward import CanonicalForward


@dataclass
class SegmentBuild:
    """A segment ready to write: its tables and parts (names relative to ``t<k>/``)."""

    tables: SegmentTables
    parts: dict[str, bytes] = field(default_factory=dict)
    token_bits_ideal: float = 0.0
    notes: list[str] = field(default_factory=list)
    static_ids: np.ndarray | None = None  # new tokens of a model-free stream (static_tokens)

    def pack_ids_if_smaller(self) -> None:
        """A model-free token stream as packed ids where that is smaller (an agent's turn:
        a static table costs more than its ~100 ids); format 1.7 files only."""
        from seqkv_codecs.packed_ids import pack_ids

        if self.static_ids is not None and len(self.static_ids):
            packed = pack_ids(self.static_ids)
            if len(packed) < len(self.parts.get("tokens", b"")):
                self.parts["tokens"] = packed

    def bytes_of(self, kind: str) -> int:
        """Bytes of parts named `kind...` (a near-duplicate's edits count as tokens)."""
        kinds = (kind, "edits") if kind == "tokens" else (kind,)
        return sum(len(d) for n, d in self.parts.items() if n.split("/")[-1].startswith(kinds))


def session_records(sources: list[Source], ends: list[tuple[int, int]]) -> SegmentTables:
    """Tables with the sessions filled in (nodes are added by the codec's encoder)."""
    profiles, profile_of, extras = profiles_for(sources)
    records = [
        SessionRecord(src.session_id, node, end, 0, profile_of[i], extras[i])
        for i, (src, (node, end)) in enumerate(zip(sources, ends, strict=True))
    ]
    return SegmentTables([], records, profiles)


def check_session(
    coder, build: SegmentBuild, local: int, cap, keys, values, surprisal, base=None, unrounded=None
) -> None:
    """Residual of one session against the K/V the trie reproduces, and its stored extras.

    `base` = (local index, capture, positions): an earlier session of the segment whose first
    `positions` positions this one shares; a part whose residual is smaller against that
    session's K/V there (the same bits: llama.cpp slots of one prompt) rests on it (SKB1).
    `unrounded(kind, layer)`: the recompute before rounding to the capture's dtype, which
    models a residual far better (`SKR2`) where the capture is not canonical."""
    out = EncodedSession({}, 0.0)
    for kind, captured, recomputed in (("key", cap.keys, keys), ("value", cap.values, values)):
        for layer, (a, b) in enumerate(zip(captured, recomputed, strict=True)):
            part = f"layers.{layer}.{kind}"
            coder.add_residual(out, part, kv_bits(a), kv_bits(b), cap, unrounded)
            if base is not None:
                _rest_on_base(out, part, a, b, base, kind, layer, unrounded)
    if surprisal is not None and not torch.equal(surprisal, cap.surprisal.double()):
        out.parts["surprisal"] = encode_surprisal_part(cap.surprisal, surprisal)
        build.notes.append(f"{cap.session_id}: surprisal differs from recomputation; stored")
    for name, data in out.parts.items():
        build.parts[f"s{local}/{name}"] = data
    build.tables.sessions[local].log2_ppl_milli = ppl_milli(cap.surprisal)


MIN_SHARED_FOR_BASE = 16  # positions: below this a based residual cannot pay its header


def _rest_on_base(
    out: EncodedSession, part: str, captured, recomputed, base, kind, layer, unrounded=None
):
    from seqkv_codecs.residual import MAGIC as RESIDUAL_MAGIC
    from seqkv_codecs.residual import encode_based, encode_residual
    from seqkv_codecs.rounding_residual import DTYPES as ROUNDED
    from seqkv_codecs.rounding_residual import MAGIC as ROUNDING_MAGIC
    from seqkv_codecs.rounding_residual import encode_rounding_residual

    name = f"residual.{part}"
    if out.parts.get(name, b"")[:4] not in (RESIDUAL_MAGIC, ROUNDING_MAGIC):  # nothing to save on
        return
    base_local, load_base, positions = base
    base_cap = load_base()
    theirs = (base_cap.keys if kind == "key" else base_cap.values)[layer]
    if theirs.dtype != captured.dtype or theirs.shape[0::2] != captured.shape[0::2]:
        return
    reference = torch.cat([theirs[:, :positions], recomputed[:, positions:]], dim=1)
    inner = encode_residual(kv_bits(captured), kv_bits(reference))
    dtype = DTYPE_NAMES.get(captured.dtype)
    if unrounded is not None and dtype in ROUNDED:  # the base's bits are exact in float32
        exact = torch.cat([theirs[:, :positions].float(), unrounded(kind, layer)[:, positions:]], 1)
        if exact.shape == captured.shape:
            modelled = encode_rounding_residual(
                kv_bits(captured), exact.contiguous().numpy(), dtype
            )
            inner = min(inner, modelled, key=len)
    data = encode_based(base_local, positions, inner)
    if len(data) < len(out.parts.get(name, b"")):
        out.residual_bytes += len(data) - len(out.parts[name])
        out.parts[name] = data


def residual_bases(sources: list[Source], members) -> dict[int, tuple[int, int]]:
    """{session: (earlier session, shared positions)}: each session's longest token prefix in
    common with an earlier session of the segment that rests on none (so restore needs one
    extra session at most). Only exact residuals rest on another session."""
    bases: dict[int, tuple[int, int]] = {}
    # A base must share MIN_SHARED_FOR_BASE tokens: only roots with the same first ones can
    # be one, so sessions are compared within those groups, not all against all.
    roots: dict[tuple, list[int]] = {}
    for local, src in enumerate(sources):
        if local in members or src.recompute:
            continue
        key = tuple(src.tokens[:MIN_SHARED_FOR_BASE].tolist())
        best, shared = -1, 0
        for r in roots.get(key, []) if len(key) == MIN_SHARED_FOR_BASE else []:
            other = sources[r].tokens
            n = min(len(other), len(src.tokens))
            diff = np.flatnonzero(other[:n] != src.tokens[:n])
            common = int(diff[0]) if diff.size else n
            if common > shared:
                best, shared = r, common
        if shared >= MIN_SHARED_FOR_BASE:
            bases[local] = (best, shared)
        else:
            roots.setdefault(key, []).append(local)
    return bases


def encode_model_segment(
    trie: Trie,
    first_new: int,
    sources: list[Source],
    ends: list[tuple[int, int]],
    coder,
    canon: CanonicalForward,
    on_progress=None,
    members: dict[int, int] | None = None,
    on_session=None,
) -> SegmentBuild:
    """Walk the nodes this segment needs; code its new nodes; check its sessions.

    `members` ({session: centroid session}) are stored as edits of their centroid
    (neardup_store.py) instead of as trie paths. `on_session(local, capture)` sees each
    tokens-only session as the Capture the walk recomputed for it (what `seqkv pipeline`
    writes as its captures: one walk of the model for capture and coding).
    """
    members = members or {}
    build = SegmentBuild(session_records(sources, ends))
    adapter = CanonicalLogits(canon)
    by_node: dict[int, list[int]] = {}
    for local, (node, _) in enumerate(ends):
        if local not in members:
            by_node.setdefault(node, []).append(local)
    needed = set(range(first_new, len(trie.nodes)))
    for node in list(needed | set(by_node)):
        while node >= 0:
            needed.add(node)
            node = trie.nodes[node].parent
    coded: dict[int, tuple[bytes, float]] = {}
    sequential = capabilities(coder).steps_model
    dtype_of = {local: DTYPES[src.meta["dtype"]] for local, src in enumerate(sources)}
    exact = getattr(coder, "lossless", False) and getattr(coder, "residual", None) == "lossless"
    bases = residual_bases(sources, members) if exact else {}

    def visit(run: Run) -> None:
        if sequential and run.node >= first_new:
            coded[run.node] = _code_node(run, adapter, coder.precision_bits)
        else:
            prefill(adapter, run)
        for local in by_node.get(run.node, []):
            src = sources[local]
            end = ends[local][1]
            keys, values, surprisal = session_kv(run, end, dtype_of[local], canon.num_layers)
            cap = src.recomputed(keys, values, surprisal) if src.recompute else src.load()
            base = None
            if local in bases and src.coder_for(coder) is coder:
                b, shared = bases[local]
                base = (b, functools.cache(sources[b].load), shared)
            unrounded = unrounded_kv(run.track.state, run.start + end)
            check_session(
                sources[local].coder_for(coder),
                build,
                local,
                cap,
                keys,
                values,
                surprisal,
                base,
                unrounded,
            )
            if on_session and src.recompute:
                on_session(local, cap)
            if on_progress:
                on_progress(cap.positions)

    walk(trie, needed, adapter, visit)
    for local, centroid in sorted(members.items()):
        _encode_member(build, local, centroid, sources, coder, adapter)
        if on_progress:
            on_progress(len(sources[local].tokens))
    for index in range(first_new, len(trie.nodes)):
        node = trie.nodes[index]
        payload, bits = coded.get(index, (b"", 0.0))
        build.token_bits_ideal += bits
        build.tables.nodes.append(
            Node(node.parent, node.attach, len(node.tokens), len(payload), node_check(node.tokens))
        )
    new_tokens = [trie.nodes[i].tokens for i in range(first_new, len(trie.nodes))]
    if sequential:
        build.parts["tokens"] = b"".join(coded[i][0] for i in range(first_new, len(trie.nodes)))
    else:
        build.parts["tokens"] = static_tokens(new_tokens, canon.vocab_size, build)
    return build


def _encode_member(build, local: int, centroid: int, sources, coder, adapter) -> None:
    """A near-duplicate session: its edits against the centroid, checked by a prefill."""
    from seqkv_cli.trie.neardup_store import encode_member
    from seqkv_cli.trie.oracle import RowStream

    src = sources[local]
    build.parts[f"s{local}/edits"] = encode_member(
        centroid, sources[centroid].tokens, src.tokens, adapter, coder.precision_bits
    )
    adapter.tracks.clear()
    track = RowStream(adapter, src.tokens).finish()
    keys, values = track.kv(adapter.canon.num_layers, DTYPES[src.meta["dtype"]])
    check_session(
        src.coder_for(coder),
        build,
        local,
        src.load(),
        keys,
        values,
        track.surprisal,
        unrounded=track.unrounded,
    )
    adapter.tracks.clear()


def walk(trie: Trie, needed: set[int], adapter: CanonicalLogits, visit) -> None:
    """Depth first over `needed` nodes, each run from a fork of its parent's run."""
    kids: dict[int, list[int]] = {}
    for n in sorted(needed):
        kids.setdefault(trie.nodes[n].parent, []).append(n)
    stack: list[tuple[Run | None, list[int]]] = [(None, list(reversed(kids.get(-1, []))))]
    while stack:
        parent, todo = stack[-1]
        if not todo:
            stack.pop()  # the parent's state is released here
            continue
        n = todo.pop()
        node = trie.nodes[n]
        run = start_run(adapter, parent, n, node.start, node.attach, len(node.tokens), node.tokens)
        run.want_rows = {trie.nodes[c].attach for c in kids.get(n, [])}
        visit(run)
        adapter.tracks.clear()  # runs hold their tracks; the adapter must not pin them
        stack.append((run, list(reversed(kids.get(n, [])))))


def _code_node(run: Run, adapter: CanonicalLogits, precision: int) -> tuple[bytes, float]:
    """Prefill the node and range-code its tokens under the rows that prefill produces."""
    from seqkv_codecs.sequential.node_stream import encode_node, intervals
    from seqkv_codecs.sequential.probability import frequencies_from_logits, intervals_from_logits
    from seqkv_codecs.sequential.token_coder import uniform_row

    tokens, n = run.tokens, run.n_tokens
    first = (
        uniform_row(adapter.vocab_size, precision)[None]
        if run.first_row is None
        else frequencies_from_logits(run.first_row.numpy()[None], precision)
    )
    lows, freqs = [], []
    low, freq = intervals(first, tokens[:1])
    lows.append(low)
    freqs.append(freq)

    def on_rows(s: int, logits: torch.Tensor) -> None:
        valid = min(len(logits), n - 1 - s)
        if valid > 0:
            lo, fr = intervals_from_logits(
                logits[:valid].numpy(), tokens[s + 1 : s + 1 + valid], precision
            )
            lows.append(lo)
            freqs.append(fr)

    prefill(adapter, run, on_rows)
    low, freq = np.concatenate(lows), np.concatenate(freqs)
    bits = float((precision - np.log2(freq.astype(np.float64))).sum())
    return encode_node(low, freq, precision), bits


def node_check(tokens: np.ndarray) -> int:
    """The tables' check value of a node's tokens."""
    from seqkv_codecs.sequential.node_stream import token_check

    return token_check(tokens)


def static_tokens(token_runs: list[np.ndarray], vocab: int, build: SegmentBuild) -> bytes:
    """All new tokens of the segment under one static rANS table (seq-fast, per-vector)."""
    from seqkv_codecs.entropy import encode_symbols

    tokens = np.concatenate(token_runs) if token_runs else np.zeros(0, np.int64)
    build.static_ids = tokens
    counts = np.bincount(tokens, minlength=vocab)
    p = counts[counts > 0] / max(len(tokens), 1)
    build.token_bits_ideal += float(-(counts[counts > 0] * np.log2(p)).sum())
    return encode_symbols(tokens, vocab) if len(tokens) else b""


def refuse_empty(sources: list[Source]) -> None:
    for src in sources:
        if len(src.tokens) == 0:
            raise SeqkvError(f"session {src.session_id} has no tokens; nothing to archive")
