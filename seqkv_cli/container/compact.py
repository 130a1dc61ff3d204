"""Compact files: `seq`/`seq-fast` sessions with a binary header instead of the full layout.

A one-session file in the full layout pays ~900 bytes of superblock, JSON index and trie
tables: more than the token stream of a few hundred tokens under a good model. The compact
single-session layout (format 1.2) keeps only what decoding needs, in a binary header: the
pipeline as one enumerated byte, the model by the first 8 bytes of its fingerprint, the
session's shape and length, its id, a token checksum and two CRC32Cs. The compact archive
layout (format 1.8) holds many sessions the same way: the shared part of that header, then
one trie segment's table, deflated, and its tokens; an agent's compacted memory of 50 turns
then costs a few bytes a turn beyond its tokens instead of ~600 bytes of JSON and index.
Capture provenance (source path, capture time, versions) is not kept in either: it is what a
user gives up for the small file (`--layout trie` keeps it).

Byte layouts and the enumerations: docs/FORMAT.md, "Compact single-session files" and
"Compact archives". This module uses only the standard library and the container's CRC32C,
like the rest of the package; what the table says is the trie's business (trie/compact.py).
"""

from __future__ import annotations

import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from seqkv_cli.container.errors import (
    ContainerWriteError,
    InvalidContainerInputError,
)
from seqkv_cli.container.format import (
    FORMAT_MAJOR,
    MAGIC,
    crc32c,
    encode_varint,
)
from seqkv_cli.fsutil import PublishError, atomic_path, describe_os_error

COMPACT_MINOR = 2  # format 1.2 added this layout
V2_MINOR = 3  # 1.3 added the portable-fx53-v2 codes: a 1.2 reader asks for an upgrade
V3_MINOR = 5  # 1.5 added the portable-fx53-v3 codes: a 1.4 reader asks for an upgrade
# The minor that introduced a numeric path's codes: a file takes the newest its codes need
# (older readers read what they can), and a file of an older minor cannot hold them.
PATH_MINOR = {"portable-fx53-v2": V2_MINOR, "portable-fx53-v3": V3_MINOR}
ARCHIVE_MINOR = 8  # 1.8 added the compact archive layout: a 1.7 reader asks for an upgrade
LAYOUT_COMPACT = 1  # byte 12: 0 would be the full layout's reserved (zero) word
LAYOUT_ARCHIVE = 4  # a compact archive (2 and 3 name the full layout's record encodings)
FIXED_HEADER = struct.Struct(
    "<8sHHBB8sB"
)  # magic, major, minor, layout, pipeline, fingerprint, kinds
FINGERPRINT_HEX = 16  # the first 8 bytes of the model's SHA-256 fingerprint

# Enumerations (docs/FORMAT.md): a value's position is its code. Appending is a minor change.
CODECS = ("seq", "seq-fast")
RESIDUALS = ("lossless", "none")
NUMERICS = (
    "portable-fx53-v1",
    "canonical-fp32-rb8-kb256-v1",
    "portable-fx53-v2",
    "portable-fx53-v3",
)
DTYPES = ("bf16", "fp16", "fp32")
CAPTURE_PATHS = (
    "portable-fx53-v1",
    "canonical-fp32-rb8-kb256-v1",
    "user-cache",
    "unknown",
    "portable-fx53-v2",
    "portable-fx53-v3",
)
PRECISION_BITS, CHUNK_SIZE = 24, 1024  # the only pipeline parameters this layout can hold

TOKENS_SECTION = "t1/tokens"  # how the one payload is named to readers of the trie layout
ARCHIVE_SECTION = "t1/index"  # a compact archive's table and tokens, as a version-2 segment
MAX_ID_BYTES = 1024
MAX_HEADER_BYTES = FIXED_HEADER.size + 6 * 10 + 4 + MAX_ID_BYTES + 4  # varints of at most 10 bytes
# Bounds on the shape fields: far past any model in use, small enough that nothing built
# from them can be large before the model itself is checked against them.
MAX_SHAPE = 0xFFFF  # as the full layout's session entries (archive/entries.py)
MAX_POSITIONS = 1 << 31


@dataclass(frozen=True)
class CompactProfile:
    """What every session of a compact file shares: pipeline, model, dtype and shapes."""

    codec: str
    residual: str
    numerics: str
    fingerprint: str  # FINGERPRINT_HEX lowercase hex digits
    dtype: str
    numeric_path: str
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def pipeline_config(self) -> dict[str, Any]:
        return {
            "id": self.codec,
            "precision_bits": PRECISION_BITS,
            "chunk_size": CHUNK_SIZE,
            "residual": self.residual,
            "numerics": self.numerics,
        }

    def codes(self) -> tuple[int, int, int]:
        """The pipeline byte, the kinds byte and the oldest minor that holds their codes."""
        pipeline = (
            CODECS.index(self.codec)
            | RESIDUALS.index(self.residual) << 1
            | NUMERICS.index(self.numerics) << 2
        )
        kinds = DTYPES.index(self.dtype) | CAPTURE_PATHS.index(self.numeric_path) << 4
        return pipeline, kinds, max(minor_of(self.numerics), minor_of(self.numeric_path))


@dataclass(frozen=True)
class CompactSession(CompactProfile):
    """Everything a compact single-session file says about its session, besides its tokens."""

    session_id: str
    positions: int
    log2_ppl_milli: int  # 0xFFFF: unknown (fewer than two positions)
    token_check: int  # low 16 bits of CRC-32 (zlib) of the token ids as uint32 LE


def unrepresentable(
    config: dict, numeric_path: str, dtype: str, session_id: str | None = None
) -> str | None:
    """Why sessions with this pipeline config cannot be in a compact file (None: they can)."""
    expected = {"id", "precision_bits", "chunk_size", "residual", "numerics"}
    if set(config) != expected:
        extra = sorted(set(config) - expected)
        return f"its codec has settings the compact layout cannot hold ({', '.join(extra)})"
    for value, known, what in (
        (config["id"], CODECS, "codec"),
        (config["residual"], RESIDUALS, "residual mode"),
        (config["numerics"], NUMERICS, "numeric path"),
        (numeric_path, CAPTURE_PATHS, "capture numeric path"),
        (dtype, DTYPES, "dtype"),
    ):
        if value not in known:
            return f"its {what} {value!r} has no compact code"
    if (config["precision_bits"], config["chunk_size"]) != (PRECISION_BITS, CHUNK_SIZE):
        return "its precision or chunk size is not the default"
    if session_id is not None and id_problem(session_id):
        return f"its session id is {id_problem(session_id)}"
    return None


def id_problem(session_id: Any) -> str | None:
    if not isinstance(session_id, str) or not session_id:
        return "empty"
    try:
        raw = session_id.encode("utf-8")
    except UnicodeEncodeError:
        return "not valid Unicode"
    if len(raw) > MAX_ID_BYTES:
        return f"over {MAX_ID_BYTES} bytes"
    if any(ord(c) < 32 or 127 <= ord(c) < 160 for c in session_id):
        return "made of control characters in part"
    return None


def encode_compact(session: CompactSession, payload: bytes) -> bytes:
    """The whole file: header, its CRC32C, the token payload and the payload's CRC32C."""
    head = _fixed_header(session, LAYOUT_COMPACT, session.session_id)
    for value in (session.num_layers, session.num_kv_heads, session.head_dim, session.positions):
        head += encode_varint(value)
    head += struct.pack("<HH", session.log2_ppl_milli, session.token_check)
    name = session.session_id.encode("utf-8")
    head += encode_varint(len(name)) + name + encode_varint(len(payload))
    head += crc32c(bytes(head)).to_bytes(4, "little")
    return bytes(head) + payload + crc32c(payload).to_bytes(4, "little")


def encode_compact_archive(
    profile: CompactProfile, table: bytes, payload: bytes, minor: int = ARCHIVE_MINOR
) -> bytes:
    """A compact archive: header, its CRC32C, the segment table deflated, the token payload,
    and one CRC32C of the two (docs/FORMAT.md, "Compact archives"). `minor`: the oldest its
    table may be read by (9 where it holds replay records)."""
    deflater = zlib.compressobj(9, zlib.DEFLATED, -15)  # raw deflate: the CRC32C guards it
    packed = deflater.compress(table) + deflater.flush()
    head = _fixed_header(profile, LAYOUT_ARCHIVE, None, minor)
    for value in (profile.num_layers, profile.num_kv_heads, profile.head_dim):
        head += encode_varint(value)
    head += encode_varint(len(packed)) + encode_varint(len(payload))
    head += crc32c(bytes(head)).to_bytes(4, "little")
    body = packed + payload
    return bytes(head) + body + crc32c(body).to_bytes(4, "little")


def _fixed_header(
    profile: CompactProfile, layout: int, session_id: str | None, least: int = ARCHIVE_MINOR
) -> bytearray:
    reason = unrepresentable(
        profile.pipeline_config(), profile.numeric_path, profile.dtype, session_id
    )
    if reason or len(profile.fingerprint) != FINGERPRINT_HEX:
        raise InvalidContainerInputError("<compact>", f"not a compact session: {reason}")
    pipeline, kinds, minor = profile.codes()
    if layout == LAYOUT_ARCHIVE:
        minor = max(minor, least)
    fields = (MAGIC, FORMAT_MAJOR, minor, layout, pipeline, bytes.fromhex(profile.fingerprint))
    return bytearray(FIXED_HEADER.pack(*fields, kinds))


def write_compact(path: str | os.PathLike[str], session: CompactSession, payload: bytes) -> int:
    """Write a compact single-session file atomically."""
    return _publish(path, encode_compact(session, payload))


def write_compact_archive(
    path: str | os.PathLike[str],
    profile: CompactProfile,
    table: bytes,
    payload: bytes,
    minor: int = ARCHIVE_MINOR,
) -> int:
    """Write a compact archive atomically."""
    return _publish(path, encode_compact_archive(profile, table, payload, minor))


def _publish(path: str | os.PathLike[str], data: bytes) -> int:
    """Write `data` atomically (temporary sibling, fsync, rename, fsync the directory)."""
    path = os.fspath(path)
    try:
        with atomic_path(Path(path)) as tmp, open(tmp, "xb") as file:
            file.write(data)
    except PublishError as error:
        raise ContainerWriteError(path, f"cannot write: {error.reason}") from None
    except OSError as error:
        raise ContainerWriteError(path, f"cannot write: {describe_os_error(error)}") from None
    return len(data)


def is_compact(head: bytes) -> bool:
    """Whether the first bytes of a file (magic checked by the caller) are a compact layout's
    (a compact archive in a file older than 1.8 is refused by the reader, naming that)."""
    return (
        len(head) > 12
        and int.from_bytes(head[8:10], "little") == FORMAT_MAJOR
        and int.from_bytes(head[10:12], "little") >= COMPACT_MINOR
        and head[12] in (LAYOUT_COMPACT, LAYOUT_ARCHIVE)
    )


def minor_of(path: str) -> int:
    return PATH_MINOR.get(path, COMPACT_MINOR)
