"""Chunk-parallel token streams: one session's tokens as k independent token streams.

A `seq` stream decodes one token per model pass because token i + 1 is coded given token i.
Cut the session into k runs and code each run as a stream of its own, and a decoder can step
the k runs side by side as rows of one pass: about n / k passes instead of n. What it costs:
each run is coded given only its own earlier tokens (its first token uniformly, like any
stream's), so the context before the run is lost to the model; the K/V of the whole session
are recomputed afterwards from all the tokens, so what restores is the same.

Layout (little-endian): magic ``b"SKPS"``, u8 version (1), u8 reserved (0), u16 k
(1..MAX_CHUNKS), k x u32 byte lengths, then the k token streams (token_coder.py) back to
back, with nothing after them. Run j holds tokens [a_j, b_j) of ``chunk_bounds(n, k)``.
"""

from __future__ import annotations

import struct

from seqkv_codecs.errors import CorruptStreamError

MAGIC = b"SKPS"
VERSION = 1
MAX_CHUNKS = 256
_HEAD = struct.Struct("<4sBBH")
_LEN = struct.Struct("<I")


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
    if not 1 <= len(streams) <= MAX_CHUNKS:
        raise ValueError(f"a parallel stream holds 1..{MAX_CHUNKS} runs, not {len(streams)}")
    head = _HEAD.pack(MAGIC, VERSION, 0, len(streams))
    return head + b"".join(_LEN.pack(len(s)) for s in streams) + b"".join(streams)


def is_parallel(data: bytes | None) -> bool:
    return data is not None and data[:4] == MAGIC


def parse_parallel(data: bytes) -> list[bytes]:
    """The runs' token streams; every inconsistency of the framing is corrupt."""
    buf = bytes(data)
    if len(buf) < _HEAD.size:
        raise CorruptStreamError(f"parallel token stream is truncated: {len(buf)} bytes")
    magic, version, reserved, k = _HEAD.unpack_from(buf)
    if magic != MAGIC:
        raise CorruptStreamError(f"not a parallel token stream: magic {magic!r}")
    if version != VERSION:
        raise CorruptStreamError(
            f"parallel token stream version {version} is not supported (only {VERSION})"
        )
    if reserved or not 1 <= k <= MAX_CHUNKS:
        raise CorruptStreamError(f"parallel token stream header is invalid ({k} runs)")
    table_end = _HEAD.size + k * _LEN.size
    if len(buf) < table_end:
        raise CorruptStreamError("parallel token stream is truncated inside its length table")
    lengths = [_LEN.unpack_from(buf, _HEAD.size + j * _LEN.size)[0] for j in range(k)]
    if any(n == 0 for n in lengths) or table_end + sum(lengths) != len(buf):
        raise CorruptStreamError(
            f"parallel token stream's run lengths ({sum(lengths)} bytes) do not match its "
            f"{len(buf) - table_end} bytes of runs"
        )
    out, offset = [], table_end
    for n in lengths:
        out.append(buf[offset : offset + n])
        offset += n
    return out
