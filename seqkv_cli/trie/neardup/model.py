"""Inserted tokens of an edit script, range-coded under the model (what `seq` would pay).

The only part of near-duplicate storage that runs a model. Each inserted token is coded under
the model's next-token row after the member's own tokens before it (a member's first token
under the uniform row, as in docs/format/TOKEN_STREAM.md), so the encoder and the decoder
must feed the model the same member prefix in the same order; that coupling is kept together
here, away from the byte layout (edits.py). Errors of the codec library (a model returning the
wrong shape, a payload that does not decode) surface as its CodecError for the caller to word.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from seqkv_cli.trie.neardup.alignment import COPY, DELETE, INSERT, Edit
from seqkv_codecs.sequential import (
    RangeDecoder,
    RangeEncoder,
    decode_symbol,
    encode_symbol,
    frequencies_from_logits,
)
from seqkv_codecs.sequential.logits_model import feed_checked

if TYPE_CHECKING:
    from seqkv_cli.sequential.adapter import CanonicalLogits

FEED_CHUNK = 256  # member tokens per model feed when encoding (the decoder steps)


def _rows(model, member: np.ndarray, positions: list[int], precision_bits: int):
    """Frequency row of each position in ``positions``, conditioned on the member's prefix."""
    wanted, rows = set(positions), {}
    if 0 in wanted:
        rows[0] = frequencies_from_logits(np.zeros(model.vocab_size, np.float32), precision_bits)
    if len(member) > 1 and wanted - {0}:
        state, last = model.start(len(member)), max(positions)
        for s in range(0, last, FEED_CHUNK):
            logits = feed_checked(model, state, member[s : min(s + FEED_CHUNK, last)])
            for p in range(s + 1, s + 1 + len(logits)):
                if p in wanted:
                    rows[p] = frequencies_from_logits(logits[p - s - 1], precision_bits)
    return [rows[p] for p in positions]


def encode_inserted(
    member: np.ndarray, positions: list[int], model: CanonicalLogits, precision_bits: int
) -> bytes:
    """One range-coder payload of ``member[p]`` for each p in ``positions`` (ascending)."""
    enc = RangeEncoder()
    rows = _rows(model, member, positions, precision_bits)
    for p, row in zip(positions, rows, strict=True):
        encode_symbol(enc, row, int(member[p]), precision_bits)
    return enc.finish()


def decode_inserted(
    edits: list[Edit],
    centroid: np.ndarray,
    payload: bytes,
    model: CanonicalLogits,
    precision_bits: int,
) -> list[Edit]:
    """``edits`` with their inserts filled, stepping the model through the member as it is
    rebuilt (the payload must be consumed exactly)."""
    dec, out, fed, pos, filled = RangeDecoder(payload), [], 0, 0, []
    state = model.start(sum(e.length for e in edits if e.op != DELETE))
    for e in edits:
        if e.op != INSERT:
            out += centroid[pos : pos + e.length].tolist() if e.op == COPY else []
            pos += e.length
            filled.append(e)
            continue
        for _ in range(e.length):
            if out:
                logits = feed_checked(model, state, np.asarray(out[fed:], np.int64))[-1]
                fed = len(out)
            else:
                logits = np.zeros(model.vocab_size, np.float32)
            row = frequencies_from_logits(logits, precision_bits)
            out.append(decode_symbol(dec, row, precision_bits))
        filled.append(Edit(INSERT, e.length, tuple(out[-e.length :])))
    dec.finish_check()
    return filled
