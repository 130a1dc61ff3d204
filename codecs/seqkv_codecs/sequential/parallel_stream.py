"""Chunk-parallel token streams: one session's tokens as k independent token streams.

A `seq` stream decodes one token per model pass because token i + 1 is coded given token i.
Cut the session into k runs and code each run as a stream of its own, and a decoder can step
the k runs side by side as rows of one pass: about n / k passes instead of n. What it costs:
each run is coded given only its own earlier tokens (its first token uniformly, like any
stream's), so the context before the run is lost to the model; the K/V of the whole session
are recomputed afterwards from all the tokens, so what restores is the same.

Version 2 (written): the runs share one header, since they share everything but their
tokens. Magic ``b"SKPS"``, u8 version (2), u8 P, u16 k, u32 V, u32 N (the session's tokens),
u32 C (tokens per range-coded chunk), then for every chunk of every run in order (run j holds
tokens [a_j, b_j) of ``chunk_bounds(N, k)``, cut into chunks of C) a varint payload length and
a u32 CRC32 of the chunk's token ids, then a u32 CRC32 of everything before it, then the
payloads back to back. Parsing expands it into the k token streams (token_coder.py) that the
encoder made, byte for byte, so the decoder is the one every `seq` stream uses; the framing
costs ~5 bytes a chunk instead of a stream header (~36 bytes) per run.

Version 1 (read only): u8 version (1), u8 reserved (0), u16 k, k x u32 byte lengths, then the
k token streams back to back, with nothing after them.
"""

from __future__ import annotations

import struct

from seqkv_codecs.errors import CorruptStreamError
from seqkv_codecs.framing import StreamReader, with_crc32
from seqkv_codecs.sequential.token_coder import assemble_token_stream, parse_token_stream
from seqkv_codecs.varint import encode_varint

MAGIC = b"SKPS"
VERSION = 2  # written; 1 is still read
MAX_CHUNKS = 256
_HEAD = struct.Struct("<4sBBH")  # magic, version, (v1: reserved | v2: P), k
_AFTER_VERSION = "<BH"  # _HEAD after its magic and version
_SHARED = struct.Struct("<III")  # v2: V, N, C
_LEN = struct.Struct("<I")
_MAX_CHUNK_BYTES = 1 << 32


def chunk_bounds(n: int, chunks: int) -> list[tuple[int, int]]:
    """[a, b) of each run: min(chunks, n) runs (one for an empty session), lengths differing
    by at most one, the longer ones first."""
    k = max(1, min(chunks, n))
    size, extra = divmod(n, k)
    bounds, a = [], 0
    for j in range(k):
        b = a + size + (j < extra)
        bounds.append((a, b))
        a = b
    return bounds


def pack_parallel(streams: list[bytes]) -> bytes:
    """The runs' token streams under one shared header (version 2); they must agree on the
    vocabulary, precision and chunk size, and hold the runs of one session in order."""
    if not 1 <= len(streams) <= MAX_CHUNKS:
        raise ValueError(f"a parallel stream holds 1..{MAX_CHUNKS} runs, not {len(streams)}")
    parsed = [parse_token_stream(s) for s in streams]
    shared = {(i.precision_bits, i.vocab_size, i.chunk_size) for i, _ in parsed}
    if len(shared) != 1:
        raise ValueError(f"the runs were coded with different settings: {sorted(shared)}")
    ((precision, vocab, size),) = shared
    lengths = [info.n_tokens for info, _ in parsed]
    n = sum(lengths)
    if lengths != [b - a for a, b in chunk_bounds(n, len(streams))]:
        raise ValueError(f"runs of {lengths} tokens are not the runs of one session")
    head = _HEAD.pack(MAGIC, VERSION, precision, len(streams)) + _SHARED.pack(vocab, n, size)
    table = b"".join(
        encode_varint(len(payload)) + _LEN.pack(crc)
        for _, chunks in parsed
        for _, _, payload, crc in chunks
    )
    head = with_crc32(head + table)
    return head + b"".join(payload for _, chunks in parsed for _, _, payload, _ in chunks)


def is_parallel(data: bytes | None) -> bool:
    return data is not None and data[:4] == MAGIC


def parse_parallel(data: bytes) -> list[bytes]:
    """The runs' token streams; every inconsistency of the framing is corrupt."""
    reader = StreamReader(data, "parallel token")
    version = reader.opening(MAGIC, (1, 2))
    third, k = reader.unpack(_AFTER_VERSION)
    if not 1 <= k <= MAX_CHUNKS or (version == 1 and third):
        raise CorruptStreamError(f"parallel token stream header is invalid ({k} runs)")
    return _parse_v1(reader, k) if version == 1 else _parse_v2(reader, third, k)


def _parse_v1(reader: StreamReader, k: int) -> list[bytes]:
    lengths = reader.unpack(f"<{k}I")
    left = reader.left
    if any(n == 0 for n in lengths) or sum(lengths) != left:
        raise CorruptStreamError(
            f"parallel token stream's run lengths ({sum(lengths)} bytes) do not match its "
            f"{left} bytes of runs"
        )
    return [bytes(reader.take(n)) for n in lengths]


def _parse_v2(reader: StreamReader, precision: int, k: int) -> list[bytes]:
    vocab, n, size = reader.unpack(_SHARED.format)
    runs_of_n = max(1, min(k, n))  # chunk_bounds' count: fewer tokens than runs is corrupt
    if size == 0 or not 1 <= vocab < 1 << precision <= 1 << 31 or runs_of_n != k:
        raise CorruptStreamError(
            f"parallel token stream header is invalid (P={precision}, V={vocab}, N={n}, "
            f"C={size}, {k} runs)"
        )
    runs = chunk_bounds(n, k)
    table = []
    for a, b in runs:
        chunks = []
        for _ in range(a, b, size):
            length = reader.varint(max_bytes=5)
            (crc,) = reader.unpack("<I")
            if not 0 < length < _MAX_CHUNK_BYTES:
                raise CorruptStreamError(f"parallel token stream names a {length}-byte chunk")
            chunks.append((length, crc))
        table.append(chunks)
    reader.crc32()
    total = sum(length for chunks in table for length, _ in chunks)
    left = reader.left
    if total != left:
        raise CorruptStreamError(
            f"parallel token stream's chunks ({total} bytes) do not match its "
            f"{left} bytes of payload"
        )
    out = []
    for (a, b), chunks in zip(runs, table, strict=True):
        parts = [(bytes(reader.take(length)), crc) for length, crc in chunks]
        out.append(assemble_token_stream(precision, vocab, b - a, size, parts))
    return out
