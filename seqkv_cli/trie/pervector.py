"""Trie archives for per-vector codecs: a shared prefix's K/V blocks stored once.

Without a model nothing is recomputed: each node keeps its own positions' K/V, one codec
block per layer and kind (taken from the session that created the node), plus its tokens
and surprisal. A session is restored by concatenating the blocks along its path. K/V depends
only on the prefix, so for canonical captures the blocks are every sharing session's own
bits; where a session's capture differs (non-canonical numerics), lossless codecs store an
exact residual for it, lossy codecs restore the shared blocks within their own error bound.
"""

from __future__ import annotations

import numpy as np
import torch

from seqkv_cli.errors import SeqkvError
from seqkv_cli.kvcapture.blocks import to_block, to_tensor
from seqkv_cli.sequential.session_codec import finish_capture, kv_bits
from seqkv_cli.trie.encode import SegmentBuild, node_check, session_records, static_tokens
from seqkv_cli.trie.sources import ppl_milli
from seqkv_cli.trie.store import chain
from seqkv_cli.trie.tables import Node

KINDS = ("key", "value")


def _slices(cap, start: int, stop: int):
    keys = [k[:, start:stop] for k in cap.keys]
    values = [v[:, start:stop] for v in cap.values]
    return keys, values


def encode_pervector_segment(
    trie, first_new, sources, ends, coder, on_progress, archived=None
) -> SegmentBuild:
    """`archived(n)` gives an archived node's (keys, values) when a new session's path
    includes one (`archive add`)."""
    from seqkv_codecs.residual import encode_residual

    build = SegmentBuild(session_records(sources, ends))
    layers = int(sources[0].meta["num_layers"])
    build.tables.kv_blocks = 2 * layers
    raw: dict[int, tuple[list, list]] = {}  # node -> its K/V slices, as restore will give them
    kv_parts, surprisal_parts, loaded = [], [], {}
    for index in range(first_new, len(trie.nodes)):
        node = trie.nodes[index]
        cap = loaded.get(node.creator) or sources[node.creator].load()
        loaded = {node.creator: cap}  # one capture in memory at a time
        stop = node.start + len(node.tokens)
        keys, values = _slices(cap, node.start, stop)
        lengths = []
        for layer in range(layers):
            for kind, tensor in zip(KINDS, (keys[layer], values[layer]), strict=True):
                block = to_block(tensor, cap.meta["dtype"], kind)
                data = coder.encode(block)
                kv_parts.append(data)
                lengths.append(len(data))
                if not coder.lossless:  # what restore will give back
                    (keys if kind == "key" else values)[layer] = to_tensor(coder.decode(data))
        surprisal = cap.surprisal[max(node.start - 1, 0) : stop - 1].double()
        raw[index] = (keys, values, surprisal)
        surprisal_parts.append(surprisal.numpy().astype("<f8").tobytes())
        build.tables.nodes.append(
            Node(
                node.parent,
                node.attach,
                len(node.tokens),
                0,
                node_check(node.tokens),
                tuple(lengths),
            )
        )
    for local, (end_node, end) in enumerate(ends):
        cap = sources[local].load()
        keys, values, surprisal = _assemble(trie, end_node, end, raw, archived)
        if not torch.equal(surprisal, cap.surprisal.double()):
            build.parts[f"s{local}/surprisal"] = (
                cap.surprisal.double().numpy().astype("<f8").tobytes()
            )
        if coder.lossless:
            for kind, mine, shared in (("key", cap.keys, keys), ("value", cap.values, values)):
                for layer, (a, b) in enumerate(zip(mine, shared, strict=True)):
                    if not torch.equal(_as_bits(a), _as_bits(b)):
                        part = f"s{local}/residual.layers.{layer}.{kind}"
                        build.parts[part] = encode_residual(kv_bits(a), kv_bits(b))
        build.tables.sessions[local].log2_ppl_milli = ppl_milli(cap.surprisal)
        if on_progress:
            on_progress(cap.positions)
    build.parts["kv"] = b"".join(kv_parts)
    build.parts["surprisal"] = b"".join(surprisal_parts)
    new_tokens = [trie.nodes[i].tokens for i in range(first_new, len(trie.nodes))]
    alphabet = 1 + max((int(t.max()) for t in new_tokens if len(t)), default=0)
    build.parts["tokens"] = static_tokens(new_tokens, alphabet, build)
    return build


def _as_bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _assemble(trie, end_node: int, end: int, raw: dict, archived):
    """A session's K/V from the node slices along its path."""
    path = []
    node = end_node
    while node >= 0:
        path.append(node)
        node = trie.nodes[node].parent
    path.reverse()
    used = [trie.nodes[c].attach for c in path[1:]] + [end]
    for n in path:
        if n not in raw:
            if archived is None:
                raise SeqkvError("internal: a per-vector session's path includes an unread node")
            raw[n] = archived(n)
    steps = list(zip(path, used, strict=True))
    layers = range(len(raw[path[0]][0]))
    keys = [torch.cat([raw[n][0][i][:, :u] for n, u in steps], 1) for i in layers]
    values = [torch.cat([raw[n][1][i][:, :u] for n, u in steps], 1) for i in layers]
    # a root's surprisal starts at its second token; a branch's at its first
    surprisal = torch.cat([raw[n][2][: u - (k == 0)] for k, (n, u) in enumerate(steps)])
    return keys, values, surprisal


def restore_pervector(arc, wanted: list[int], reads: dict):
    """Yield (session index, Capture or error); each node's blocks are decoded once."""
    from seqkv_cli.trie.node_source import NodeSource

    contents = arc.trie
    source = NodeSource(contents, arc.read_part, 1 << 32, 24)
    offsets = surprisal_offsets(contents)
    decoded: dict[int, tuple] = {}  # node -> (keys, values, surprisal), shared by sessions
    tokens_of: dict[int, np.ndarray] = {}
    for s in wanted:
        entry = arc.sessions[s]
        rec = contents.sessions[s]

        def archived(n: int, entry=entry):
            tokens_of[n], keys, values, surprisal = node_blocks(arc, source, n, offsets, entry)
            return keys, values, surprisal

        try:
            keys, values, surprisal = _assemble(contents, rec.end_node, rec.end, decoded, archived)
            path = chain(contents.nodes, rec.end_node)
            used = [contents.nodes[c].attach for c in path[1:]] + [rec.end]
            tokens = np.concatenate([tokens_of[n][:u] for n, u in zip(path, used, strict=True)])
            yield (
                s,
                finish_capture(entry, reads[s], tokens, keys, values, surprisal, residuals=False),
            )
        except SeqkvError as exc:
            yield s, exc


def surprisal_offsets(contents) -> dict[int, int]:
    """Per node: where its surprisal values start in its segment's surprisal part."""
    out, cursor = {}, {}
    for i, node in enumerate(contents.nodes):
        at = cursor.get(node.segment, 0)
        out[i] = at
        cursor[node.segment] = at + node.n_tokens - (1 if node.parent < 0 else 0)
    return out


def node_blocks(arc, source, n: int, offsets, entry):
    """(tokens, keys, values, surprisal) of one node, decoded from its blocks."""
    from seqkv_codecs.errors import CodecError

    node = arc.trie.nodes[n]
    kv = arc.read_part(node.segment, "kv")
    cursor, keys, values = node.kv_offset, [], []
    heads, hd = entry["shapes"]["num_kv_heads"], entry["shapes"]["head_dim"]
    if len(node.kv_lengths) != 2 * entry["shapes"]["num_layers"]:
        raise SeqkvError(f"node {n}: it has {len(node.kv_lengths)} K/V blocks, not 2 per layer")
    if cursor + sum(node.kv_lengths) > len(kv):
        raise SeqkvError(f"node {n}: its K/V blocks run past the segment's K/V part")
    for b, length in enumerate(node.kv_lengths):
        kind = KINDS[b % 2]
        try:  # the block's header is checked against the node before anything is decoded
            block = arc.codec.decode_checked(
                kv[cursor : cursor + length], (heads, node.n_tokens, hd), entry["dtype"], kind
            )
        except CodecError as exc:
            raise SeqkvError(f"node {n}: a K/V block does not decode: {exc}") from None
        (keys if b % 2 == 0 else values).append(to_tensor(block))
        cursor += length
    count = node.n_tokens - (1 if node.parent < 0 else 0)
    data = arc.read_part(node.segment, "surprisal")[8 * offsets[n] : 8 * (offsets[n] + count)]
    if len(data) != 8 * count:
        raise SeqkvError(f"node {n}: its surprisal values are missing")
    surprisal = torch.from_numpy(np.frombuffer(data, "<f8").copy())
    return source.tokens(n), keys, values, surprisal
