"""Token ids range-coded under the language model's own next-token distribution.

Position i costs -log2 P(t_i | t_<i) bits. The encoder prefills the model in big chunks; the
decoder can only step, one token per model call, because it learns token i by decoding it.
Both sides must therefore see bit-identical logits (docs/NUMERICS.md). Positions are cut into
chunks, each its own range-coder stream with a CRC32 of its token ids, so a decoder whose
model or numerics differ stops at the first bad chunk and says which one, instead of
returning wrong tokens. Byte-level spec: docs/TOKEN_STREAM.md.

This module writes and parses the stream and decodes one symbol; the decoder that steps the
model (`decode_tokens`, `decode_tokens_batch`) lives in batch_decode.py, which imports this
module and never the other way round.
"""

from __future__ import annotations

import functools
import struct
import zlib
from dataclasses import dataclass
from operator import index

import numpy as np

from seqkv_codecs.errors import CodecError, CorruptStreamError
from seqkv_codecs.framing import StreamReader, with_crc32
from seqkv_codecs.sequential.logits_model import LogitsModel, feed_checked
from seqkv_codecs.sequential.probability import (
    find_symbol,
    frequencies_from_logits,
    intervals_from_logits,
)
from seqkv_codecs.sequential.rangecoder import RangeDecoder, RangeEncoder

MAGIC = b"SKTK"
VERSION = 1
FIRST_TOKEN_UNIFORM = 0  # the only first-token coding of version 1
_HEAD = struct.Struct("<4sBBBBIII")  # magic, version, P, first-token coding, reserved, V, N, C
_FIELDS = "<BBBIII"  # _HEAD after its magic and version
_ENTRY = struct.Struct("<II")  # payload length, CRC32 of the chunk's token ids
_U32 = (1 << 32) - 1


@dataclass(frozen=True, eq=False)  # eq would compare arrays
class TokenStats:
    """What a token stream cost; ``position_bits[i]`` is -log2(f / 2**P) of token i."""

    position_bits: np.ndarray
    n_chunks: int
    payload_bytes: int  # range-coded bytes, all chunks
    overhead_bytes: int  # header, chunk table and header CRC

    @property
    def ideal_bits(self) -> float:
        return float(self.position_bits.sum())

    @property
    def total_bytes(self) -> int:
        return self.payload_bytes + self.overhead_bytes


@dataclass(frozen=True)
class TokenStreamInfo:
    """A stream's header, readable without a model."""

    vocab_size: int
    n_tokens: int
    precision_bits: int
    chunk_size: int
    n_chunks: int
    payload_bytes: int
    overhead_bytes: int


@functools.lru_cache(maxsize=8)
def uniform_row(vocab: int, precision_bits: int) -> np.ndarray:
    """Frequencies of the first token: the row that V zero logits give (≈ log2 V bits each)."""
    row = frequencies_from_logits(np.zeros(vocab, dtype=np.float32), precision_bits)
    row.setflags(write=False)
    return row


def token_crc(ids: np.ndarray) -> int:
    return zlib.crc32(ids.astype("<u4").tobytes())


def _intervals(ids: np.ndarray, model: LogitsModel, precision_bits: int, feed_chunk: int):
    """(cum_low, freq) of every position: one prefill feed per ``feed_chunk`` tokens."""
    n, vocab = len(ids), model.vocab_size
    low, freq = np.zeros(n, np.int64), np.zeros(n, np.int64)
    if n == 0:
        return low, freq
    first = uniform_row(vocab, precision_bits)
    low[0], freq[0] = first[: ids[0]].sum(), first[ids[0]]
    if n == 1:
        return low, freq
    state = model.start(n - 1)
    for s in range(0, n - 1, feed_chunk):
        logits = feed_checked(model, state, ids[s : min(s + feed_chunk, n - 1)])
        pos = slice(s + 1, s + 1 + len(logits))
        low[pos], freq[pos] = intervals_from_logits(logits, ids[pos], precision_bits)
    return low, freq


def _check_tokens(tokens: np.ndarray, vocab: int) -> np.ndarray:
    ids = np.asarray(tokens)
    if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
        raise CodecError(f"tokens must be a 1-D integer array, got {ids.dtype} {ids.shape}")
    if ids.size and (ids.min() < 0 or ids.max() >= vocab):
        raise CodecError(f"token ids must lie in [0, {vocab}), got {ids.min()}..{ids.max()}")
    if ids.size > _U32:
        raise CodecError(f"{ids.size} tokens exceed the stream's limit of {_U32}")
    return ids.astype(np.int64)


def encode_tokens_with_stats(
    tokens: np.ndarray,
    model: LogitsModel,
    *,
    precision_bits: int = 24,
    chunk_size: int = 256,
    feed_chunk: int = 256,
) -> tuple[bytes, TokenStats]:
    """Encode ``tokens`` (N,) under ``model``; also return what each position cost."""
    precision_bits = index(precision_bits)
    chunk_size, feed_chunk = index(chunk_size), index(feed_chunk)
    if not 1 <= chunk_size <= _U32 or feed_chunk < 1:
        raise CodecError(f"chunk_size must be in 1..{_U32} and feed_chunk >= 1")
    vocab = index(model.vocab_size)
    uniform_row(vocab, precision_bits)  # validates P against V even when there are no tokens
    ids = _check_tokens(tokens, vocab)
    low, freq = _intervals(ids, model, precision_bits, feed_chunk)
    chunks = []
    for a in range(0, len(ids), chunk_size):
        enc = RangeEncoder()
        span = slice(a, a + chunk_size)
        for c, f in zip(low[span].tolist(), freq[span].tolist(), strict=True):
            enc.encode(c, f, precision_bits)
        chunks.append((enc.finish(), token_crc(ids[span])))
    data = assemble_token_stream(precision_bits, vocab, len(ids), chunk_size, chunks)
    payload_bytes = sum(len(p) for p, _ in chunks)
    stats = TokenStats(
        position_bits=precision_bits - np.log2(freq.astype(np.float64)),
        n_chunks=len(chunks),
        payload_bytes=payload_bytes,
        overhead_bytes=len(data) - payload_bytes,
    )
    return data, stats


def assemble_token_stream(
    precision_bits: int, vocab: int, n_tokens: int, chunk_size: int, chunks: list[tuple[bytes, int]]
) -> bytes:
    """The stream's bytes from its header fields and (payload, CRC32 of the ids) per chunk:
    what the encoder writes, and what a reframed stream (parallel_stream.py) expands back to."""
    head = _HEAD.pack(
        MAGIC, VERSION, precision_bits, FIRST_TOKEN_UNIFORM, 0, vocab, n_tokens, chunk_size
    )
    head += b"".join(_ENTRY.pack(len(payload), crc) for payload, crc in chunks)
    return with_crc32(head) + b"".join(payload for payload, _ in chunks)


def encode_tokens(
    tokens: np.ndarray,
    model: LogitsModel,
    *,
    precision_bits: int = 24,
    chunk_size: int = 256,
    feed_chunk: int = 256,
) -> bytes:
    """Encode ``tokens`` (N,) under ``model``; see :func:`encode_tokens_with_stats`."""
    data, _ = encode_tokens_with_stats(
        tokens, model, precision_bits=precision_bits, chunk_size=chunk_size, feed_chunk=feed_chunk
    )
    return data


def parse_token_stream(data: bytes) -> tuple[TokenStreamInfo, list[tuple[int, int, bytes, int]]]:
    """Header and (first, stop, payload, crc) per chunk; every inconsistency is corrupt."""
    reader = StreamReader(data, "token")
    reader.opening(MAGIC, (VERSION,))
    precision, first_coding, reserved, vocab, n, size = reader.unpack(_FIELDS)
    if size == 0:
        raise CorruptStreamError("token stream's chunk size is 0: it is corrupt")
    n_chunks = -(-n // size)
    table = reader.take(n_chunks * _ENTRY.size)
    reader.crc32()
    if (
        first_coding != FIRST_TOKEN_UNIFORM
        or reserved
        or not 1 <= vocab < 1 << precision <= 1 << 31
    ):
        raise CorruptStreamError(
            f"token stream header is invalid (P={precision}, V={vocab}, first={first_coding})"
        )
    head = reader.position
    chunks = []
    for k, (length, crc) in enumerate(_ENTRY.iter_unpack(table)):
        if length == 0:
            raise CorruptStreamError(f"token stream names an empty chunk {k}")
        chunks.append((k * size, min(k * size + size, n), bytes(reader.take(length)), crc))
    reader.finish()
    info = TokenStreamInfo(vocab, n, precision, size, n_chunks, reader.position - head, head)
    return info, chunks


def read_token_stream_info(data: bytes) -> TokenStreamInfo:
    """Parse and check a stream's header and chunk table without decoding any token."""
    return parse_token_stream(data)[0]


def decode_one_token(dec: RangeDecoder, row: np.ndarray, precision_bits: int) -> int:
    symbol, low = find_symbol(row, dec.peek(precision_bits))
    dec.advance(low, int(row[symbol]), precision_bits)
    return symbol
