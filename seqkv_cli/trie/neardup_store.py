"""Near-duplicate sessions inside a trie archive (`compress --near-dup`).

A member whose prefix differs from its cluster's centroid by a small edit would branch off
the trie at the edit and pay for the whole rest of the shared prompt again. Instead its
tokens are an edit stream against the centroid (trie/neardup, docs/format/NEARDUP.md; inserted
tokens range-coded under the model for `seq`), stored as the session's ``edits`` part; its
path in the trie covers only the prefix it shares exactly. Restore decodes the centroid,
applies the edits, and recomputes the member's K/V with one canonical prefill (then its
residual, if any).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from seqkv_cli.errors import SeqkvError
from seqkv_cli.trie.neardup import align, cluster, common_prefix_len, decode_edits, encode_edits
from seqkv_codecs.errors import CorruptStreamError
from seqkv_codecs.varint import decode_varint, encode_varint

if TYPE_CHECKING:
    from seqkv_cli.runtime.forward import CanonicalForward
    from seqkv_cli.sequential.adapter import CanonicalLogits
    from seqkv_cli.trie.sources import Source

MIN_GAIN = 64  # aligned tokens beyond the exact prefix before a delta beats a trie branch
HEADER_VARINT_BYTES = 6  # the part header's two varints: at most 6 bytes (42 bits) each


def choose_members(sources: list[Source]) -> dict[int, int]:
    """{member index: centroid index} for sessions a delta stores better than a branch."""
    index = {s.session_id: i for i, s in enumerate(sources)}
    chosen: dict[int, int] = {}
    for group in cluster({s.session_id: s.tokens for s in sources}):
        c = index[group.centroid]
        others = [index[m] for m in group.members]
        for m in others:
            exact = max(
                common_prefix_len(sources[m].tokens, sources[o].tokens)
                for o in range(len(sources))
                if o != m
            )
            aligned = len(sources[m].tokens) - sum(
                e.length for e in align(sources[c].tokens, sources[m].tokens) if e.op == "insert"
            )
            if aligned - exact >= MIN_GAIN:
                chosen[m] = c
    return chosen


def encode_member(
    centroid_index: int,
    centroid: np.ndarray,
    member: np.ndarray,
    adapter: CanonicalLogits,
    precision: int,
) -> bytes:
    """The ``edits`` part: varint centroid session index, varint member length, edit stream."""
    edits = align(centroid, member)
    stream = encode_edits(edits, centroid=centroid, model=adapter, precision_bits=precision)
    return encode_varint(centroid_index) + encode_varint(len(member)) + stream


def read_header(data: bytes) -> tuple[int, int, bytes]:
    """(centroid session index, member length, edit stream) of an ``edits`` part."""
    try:
        centroid, pos = decode_varint(data, 0, max_bytes=HEADER_VARINT_BYTES)
        length, pos = decode_varint(data, pos, max_bytes=HEADER_VARINT_BYTES)
    except CorruptStreamError:
        raise SeqkvError("a near-duplicate session's edits part is damaged") from None
    return centroid, length, data[pos:]


def restore_member(
    entry: dict,
    read: Callable[[str], bytes | None],
    centroid_tokens: np.ndarray,
    canon: CanonicalForward,
    finish: Callable,
):
    """The member's Capture: edits applied to the centroid, K/V by one canonical prefill."""
    from seqkv_cli.kvcapture.capture_file import DTYPES
    from seqkv_cli.sequential.adapter import CanonicalLogits
    from seqkv_cli.trie.runs import PREFILL_CHUNK

    _, length, stream = read_header(read("edits"))
    adapter = CanonicalLogits(canon)
    tokens = decode_edits(stream, centroid_tokens, model=adapter)
    if len(tokens) != length or length != entry["positions"]:
        raise SeqkvError(f"session {entry['id']}: its edits give {len(tokens)} tokens")
    track = adapter.start(len(tokens))
    for s in range(0, len(tokens), PREFILL_CHUNK):
        ids = torch.from_numpy(tokens[s : s + PREFILL_CHUNK])
        track.record(ids, canon.forward(track.state, ids))
    keys, values = track.kv(canon.num_layers, DTYPES[entry["dtype"]])
    return finish(entry, read, tokens, keys, values, track.surprisal, unrounded=track.unrounded)
