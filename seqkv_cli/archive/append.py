"""`seqkv archive add`: new sessions become one more segment; nothing committed is rewritten.

The archive stays locked from reading its tables to committing the segment, so two adders
run one after the other and the second branches off the first's sessions. A crash before the
commit point leaves the file at its previous state (seqkv_cli/container/append.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from seqkv_cli.errors import SeqkvError
from seqkv_cli.kvcapture.capture_file import DTYPES
from seqkv_cli.sequential.registry import capabilities
from seqkv_cli.trie.encode import SegmentBuild, check_session, refuse_empty, session_records
from seqkv_cli.trie.plan import PlanNode, Trie
from seqkv_cli.trie.sources import Source
from seqkv_cli.trie.tables import Node


@dataclass
class AddResult:
    sessions: int
    positions: int
    new_tokens: int  # tokens no earlier session had at the same prefix
    added_bytes: int
    file_bytes: int


def add_captures(path: Path, capture_paths: list[Path], model=None, on_wait=None) -> AddResult:
    if not Path(path).is_file():
        raise SeqkvError(f"no such archive: {path} (create it with `seqkv compress`)")
    return add_sources(path, [Source.from_path(p) for p in capture_paths], model, on_wait)


def add_sources(path: Path, sources: list[Source], model=None, on_wait=None) -> AddResult:
    """Append sessions (capture files or in-memory captures) to the trie archive `path`."""
    from seqkv_cli.container import locked_for_append
    from seqkv_cli.sequential.registry import resolve_codec
    from seqkv_cli.trie import store
    from seqkv_cli.trie.write import build_segment, segment_sections

    if not Path(path).is_file():
        raise SeqkvError(f"no such archive: {path} (create it with `seqkv compress`)")
    refuse_empty(sources)
    with locked_for_append(path, on_wait) as appender:
        if appender.compact:
            model = _expand_compact(appender, model, path)
    if appender.compact:  # now a full-layout archive: lock it again (a waiter may be first)
        return add_sources(path, sources, model, on_wait)
    with locked_for_append(path, on_wait) as appender:
        reader = appender.reader
        header = reader.header
        stage = header["pipeline"][0] if header["pipeline"] else {}
        if "trie" not in header and isinstance(stage, dict) and stage.get("parallel", 1) != 1:
            raise SeqkvError(
                f"{path} codes each session as runs (seq --parallel): sessions cannot be added "
                "to it; compress them into another file"
            )
        if "trie" not in header:
            raise SeqkvError(
                f"{path} keeps sessions separately (flat layout); "
                "convert it with `seqkv archive compact` first"
            )
        # bounded before the model is known; _model_side checks the model's own context
        contents = store.load(reader, Path(path), max_context=store.MAX_POSITIONS)
        coder = resolve_codec(header["pipeline"][0])
        _check_new(sources, contents, header, path)
        before = reader.slot.committed_end  # a torn tail of a killed add is dropped, not kept
        first_new, segment = len(contents.nodes), len(contents.segments) + 1
        canon, source = _model_side(coder, contents, reader, model, header, path)
        trie = Trie()
        for n, node in enumerate(contents.nodes):
            known = (
                source.tokens(n)
                if source is not None and not capabilities(coder).steps_model
                else None
            )
            trie.add(PlanNode(node.parent, node.attach, node.start, known, -1, node.n_tokens))
        if capabilities(coder).steps_model:
            build = _add_seq(trie, first_new, sources, coder, canon, source)
            build.parts["index"] = _index(build, first_new)
        else:
            from seqkv_cli.trie.write import plan

            ends = plan(trie, sources)
            archived = _archived_kv(contents, source, coder, header)
            build = build_segment(trie, first_new, sources, ends, coder, canon, None, archived)
        written = appender.commit([], segment_sections(build, segment))
    new_tokens = sum(n.n_tokens for n in build.tables.nodes)
    positions = sum(len(s.tokens) for s in sources)
    return AddResult(
        len(sources), positions, new_tokens, written.file_bytes - before, written.file_bytes
    )


def _expand_compact(appender, model, path):
    """Rewrite a compact single-session file as the full trie archive it stands for (same
    token bytes, nothing decoded), so it can take a segment; the model, loaded and checked
    against the file's fingerprint, is returned for the append that follows."""
    from seqkv_cli.runtime.loading import LoadedModel, load_model
    from seqkv_cli.skv.identity import fingerprint_matches
    from seqkv_cli.trie.compact import tables_of
    from seqkv_cli.trie.store import TRIE_VERSION, part_name
    from seqkv_cli.trie.tables import encode_tables

    lm = model if isinstance(model, LoadedModel) else load_model(model)
    want = appender.reader.compact.fingerprint
    if not fingerprint_matches(want, lm.fingerprint):
        raise SeqkvError(
            f"{path} was compressed with fingerprint {want}; the loaded model has "
            f"{lm.fingerprint[:16]}; pass --model with the right one"
        )
    ident = {
        "fingerprint": lm.fingerprint,
        "tokenizer_fingerprint": lm.tokenizer_fingerprint,
        "name": lm.name,
    }
    session = appender.reader.compact
    payload = appender.reader.read_section(part_name(1, "tokens"))
    header = {
        "pipeline": [session.pipeline_config()],
        "model": ident,
        "sessions": [],
        "meta": {"expanded_from": "compact single-session file"},
        "trie": {"version": TRIE_VERSION},
    }
    index = encode_tables(tables_of(session, len(payload)), 0)
    appender.rewrite(header, [(part_name(1, "index"), index), (part_name(1, "tokens"), payload)])
    return lm


def _archived_kv(contents, source, coder, header):
    """Per-vector codecs: decode an archived node's K/V blocks when a new path needs them."""
    from types import SimpleNamespace

    from seqkv_cli.trie.pervector import node_blocks, surprisal_offsets

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


def _index(build: SegmentBuild, first_new: int) -> bytes:
    from seqkv_cli.trie.tables import encode_tables

    return encode_tables(build.tables, first_new)


def _check_new(sources: list[Source], contents, header: dict, path) -> None:
    have = {s.id for s in contents.sessions}
    seen: set[str] = set()
    want = (header.get("model") or {}).get("fingerprint")
    for src in sources:
        if src.session_id in have or src.session_id in seen:
            raise SeqkvError(f"{path} already has a session '{src.session_id}'; ids must be unique")
        seen.add(src.session_id)
        got = src.meta.get("model_fingerprint")
        if want and got != want:
            raise SeqkvError(
                f"{src.where} comes from a different model ({str(got)[:12]} vs {want[:12]}); "
                "an archive holds sessions of one model"
            )


def _model_side(coder, contents, reader, model, header, path):
    """The canonical model (checked against the archive's) and a reader of node tokens."""
    from seqkv_cli.trie.node_source import NodeSource
    from seqkv_cli.trie.store import PartReader

    if not capabilities(coder).needs_canonical:
        return None, NodeSource(contents, PartReader(reader), 1 << 32, 24)
    from seqkv_cli.skv.identity import load_canonical

    canon, ident = load_canonical(model, coder.numerics)
    want = (header.get("model") or {}).get("fingerprint")
    if ident["fingerprint"] != want:
        raise SeqkvError(
            f"{path} was compressed with fingerprint {str(want)[:16]}; the loaded model has "
            f"{ident['fingerprint'][:16]}; pass --model with the right one"
        )
    from seqkv_cli.trie.store import check_context

    check_context(contents, canon.max_context, path)
    source = NodeSource(contents, PartReader(reader), canon.vocab_size, coder.precision_bits)
    return canon, source


def _add_seq(trie: Trie, first_new: int, sources, coder, canon, source) -> SegmentBuild:
    """Each session: one prefill, matched against the trie by the oracle, its tail coded."""
    from seqkv_cli.sequential.adapter import CanonicalLogits
    from seqkv_cli.trie.oracle import NodeOracle, RowStream, match
    from seqkv_codecs.sequential.node_stream import token_check

    build = SegmentBuild(session_records(sources, [(0, 0)] * len(sources)))
    adapter = CanonicalLogits(canon)
    oracle = NodeOracle(source, coder.precision_bits)
    payloads = []
    for local, src in enumerate(sources):
        rows = RowStream(adapter, src.tokens)
        node, k, matched = match(trie, src.tokens, oracle, rows)
        if matched == len(src.tokens):
            end_node, end = trie.normalise(node, k)
        else:
            parent, attach = trie.normalise(node, k)
            payload, bits = _encode_tail(rows, src.tokens, matched, coder.precision_bits)
            tail = src.tokens[matched:].copy()
            end_node = trie.add(PlanNode(parent, attach, matched, tail, local))
            end = len(tail)
            build.tables.nodes.append(
                Node(parent, attach, len(tail), len(payload), token_check(tail))
            )
            payloads.append(payload)
            build.token_bits_ideal += bits
        record = build.tables.sessions[local]
        record.end_node, record.end = end_node, end
        track = rows.finish()
        cap = src.load()
        keys, values = track.kv(canon.num_layers, DTYPES[src.meta["dtype"]])
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
    build.parts["tokens"] = b"".join(payloads)
    return build


def _encode_tail(rows, tokens: np.ndarray, start: int, precision: int) -> tuple[bytes, float]:
    """Range-code tokens[start:] under the session's own rows; self-checked before use."""
    from seqkv_codecs.sequential.node_stream import encode_node, intervals, verify_node
    from seqkv_codecs.sequential.probability import intervals_from_logits
    from seqkv_codecs.sequential.token_coder import uniform_row

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
