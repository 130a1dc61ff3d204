"""The near-duplicate edit stream ``SKND``: an edit script as bytes, checked when read back.

The byte layout, version, limits and refusals (docs/format/NEARDUP.md) and nothing else: what
the edits are comes from alignment.py, how inserted tokens are coded under a model from model.py.
Only inserted tokens cost real bits: varints, or range-coded under the model conditioned on
the member's own prefix.
"""

from __future__ import annotations

import struct
import zlib
from typing import TYPE_CHECKING

import numpy as np

from seqkv_cli.errors import SeqkvError
from seqkv_cli.trie.neardup.alignment import COPY, DELETE, INSERT, Edit, apply_edits, token_ids
from seqkv_cli.trie.neardup.model import decode_inserted, encode_inserted
from seqkv_codecs.errors import CodecError, CorruptStreamError
from seqkv_codecs.varint import decode_varint, encode_varint

if TYPE_CHECKING:
    from seqkv_cli.sequential.adapter import CanonicalLogits

MAGIC = b"SKND"
VERSION = 1
OP_CODES = (COPY, DELETE, INSERT)  # an op's code is its index here; code 3 is refused
FLAG_MODEL, FLAG_CRC = 1, 2  # inserted tokens range-coded; member CRC present
MAX_TOKENS = 1 << 24  # far beyond any model context; bounds what a stream may claim
MAX_TOKEN_ID = (1 << 32) - 1  # a token id as a varint (uncoded inserts)
_HEAD = 7  # magic, version, flags, precision
_CRC = struct.Struct("<I")


class _Reader:
    def __init__(self, buf: bytes, pos: int) -> None:
        self.buf, self.pos = buf, pos

    def varint(self, limit: int, what: str) -> int:
        try:
            n, self.pos = decode_varint(self.buf, self.pos)
        except CorruptStreamError:
            raise SeqkvError(f"edit stream is corrupt: {what} runs past the stream") from None
        if n > limit:
            raise SeqkvError(f"edit stream is corrupt: {what} {n} exceeds {limit}")
        return n

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.buf):
            raise SeqkvError("edit stream is truncated")
        self.pos += n
        return self.buf[self.pos - n : self.pos]


def _member_crc(member: np.ndarray) -> int:
    return zlib.crc32(member.astype("<u4").tobytes())


def encode_edits(
    edits: list[Edit],
    *,
    centroid: np.ndarray | None = None,
    model: CanonicalLogits | None = None,
    precision_bits: int = 24,
) -> bytes:
    """Serialise ``edits``; with ``model`` (a `LogitsModel`) inserted tokens are range-coded.

    Given ``centroid``, the stream also carries the member's CRC, so decoding against the wrong
    centroid or model fails loudly instead of returning other tokens.
    """
    if model is not None and centroid is None:
        raise SeqkvError("coding inserted tokens under a model needs the centroid tokens")
    n_centroid = sum(e.length for e in edits if e.op != INSERT)
    base = centroid if centroid is not None else np.zeros(n_centroid, np.int64)
    member = apply_edits(edits, base)
    flags = (FLAG_MODEL if model is not None else 0) | (FLAG_CRC if centroid is not None else 0)
    body = bytearray(MAGIC + bytes([VERSION, flags, precision_bits if model is not None else 0]))
    body += encode_varint(n_centroid) + encode_varint(len(member)) + encode_varint(len(edits))
    inserted, pos = [], 0
    for e in edits:
        body += encode_varint(e.length << 2 | OP_CODES.index(e.op))
        if e.op == INSERT:
            inserted += range(pos, pos + e.length)
            if model is None:
                body += b"".join(encode_varint(t) for t in e.tokens)
        pos += 0 if e.op == DELETE else e.length
    if model is not None:
        try:
            payload = encode_inserted(member, inserted, model, precision_bits)
        except CodecError as exc:
            raise SeqkvError(f"cannot code inserted tokens under the model: {exc}") from None
        body += encode_varint(len(payload)) + payload
    if centroid is not None:
        body += _CRC.pack(_member_crc(member))
    return bytes(body) + _CRC.pack(zlib.crc32(body))


def decode_edits(
    data: bytes, centroid: np.ndarray, *, model: CanonicalLogits | None = None
) -> np.ndarray:
    """The member's token ids from an edit stream and its centroid (and model, if it used one)."""
    buf, c = bytes(data), token_ids(centroid, "centroid")
    if len(buf) < _HEAD + _CRC.size or buf[:4] != MAGIC:
        raise SeqkvError("not a seqkv edit stream (too short or wrong magic)")
    if zlib.crc32(buf[:-4]) != _CRC.unpack(buf[-4:])[0]:
        raise SeqkvError("edit stream failed its CRC: the stream is damaged")
    version, flags, precision = buf[4], buf[5], buf[6]
    if version != VERSION or flags > 3 or (flags & FLAG_MODEL and not flags & FLAG_CRC):
        raise SeqkvError(f"edit stream version {version} / flags {flags} is not supported")
    r = _Reader(buf[:-4], _HEAD)
    n_centroid = r.varint(MAX_TOKENS, "centroid length")
    if n_centroid != len(c):
        raise SeqkvError(f"edit stream expects a {n_centroid}-token centroid, got {len(c)} tokens")
    n_member = r.varint(MAX_TOKENS, "member length")
    edits = []
    for _ in range(r.varint(len(buf), "op count")):
        v = r.varint(MAX_TOKENS << 2 | 3, "op")
        if v & 3 == 3:
            raise SeqkvError("edit stream is corrupt: unknown op code 3")
        op, n = OP_CODES[v & 3], v >> 2
        tokens = ()
        if op == INSERT and not flags & FLAG_MODEL:
            tokens = tuple(r.varint(MAX_TOKEN_ID, "token id") for _ in range(min(n, len(buf))))
        edits.append(Edit(op, n, tokens))
    payload = r.take(r.varint(len(buf), "payload length")) if flags & FLAG_MODEL else b""
    crc = r.take(4) if flags & FLAG_CRC else None
    if r.pos != len(r.buf):
        raise SeqkvError(f"edit stream has {len(r.buf) - r.pos} bytes of trailing data")
    if (
        sum(e.length for e in edits if e.op != DELETE) != n_member
        or sum(e.length for e in edits if e.op != INSERT) != n_centroid
    ):
        raise SeqkvError("edit stream is corrupt: its ops disagree with the lengths it states")
    if flags & FLAG_MODEL:
        if model is None:
            raise SeqkvError("this edit stream codes inserted tokens under a model; pass model=")
        try:
            edits = decode_inserted(edits, c, payload, model, precision)
        except CodecError as exc:
            raise SeqkvError(
                f"edit stream's inserted tokens do not decode (wrong centroid or model?): {exc}"
            ) from None
    elif any(len(e.tokens) != e.length for e in edits if e.op == INSERT):
        raise SeqkvError("edit stream is truncated inside an insert")
    member = apply_edits(edits, c)
    if crc is not None and _member_crc(member) != _CRC.unpack(crc)[0]:
        raise SeqkvError("decoded member fails its CRC: wrong centroid or model for this stream")
    return member
