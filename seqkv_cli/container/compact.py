"""Compact single-session files (format 1.2): one `seq`/`seq-fast` session, ~45 bytes of framing.

A one-session file in the full layout pays ~900 bytes of superblock, JSON index and trie
tables: more than the token stream of a few hundred tokens under a good model. This layout
keeps only what decoding needs, in a binary header: the pipeline as one enumerated byte, the
model by the first 8 bytes of its fingerprint, the session's shape and length, its id, a
token checksum and two CRC32Cs. Capture provenance (source path, capture time, versions) is
not kept: it is what a user gives up for the small file (`--layout trie` keeps it).

Byte layout and the enumerations: docs/FORMAT.md, "Compact single-session files". This module
uses only the standard library and the container's CRC32C, like the rest of the package.
"""

from __future__ import annotations

import os
import struct
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
LAYOUT_COMPACT = 1  # byte 12: 0 would be the full layout's reserved (zero) word
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
MAX_ID_BYTES = 1024
MAX_HEADER_BYTES = FIXED_HEADER.size + 6 * 10 + 4 + MAX_ID_BYTES + 4  # varints of at most 10 bytes
# Bounds on the shape fields: far past any model in use, small enough that nothing built
# from them can be large before the model itself is checked against them.
MAX_SHAPE = 0xFFFF  # as the full layout's session entries (archive/entries.py)
MAX_POSITIONS = 1 << 31


@dataclass(frozen=True)
class CompactSession:
    """Everything a compact file says about its one session, besides the token payload."""

    codec: str
    residual: str
    numerics: str
    fingerprint: str  # FINGERPRINT_HEX lowercase hex digits
    session_id: str
    positions: int
    dtype: str
    numeric_path: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    log2_ppl_milli: int  # 0xFFFF: unknown (fewer than two positions)
    token_check: int  # low 16 bits of CRC-32 (zlib) of the token ids as uint32 LE

    def pipeline_config(self) -> dict[str, Any]:
        return {
            "id": self.codec,
            "precision_bits": PRECISION_BITS,
            "chunk_size": CHUNK_SIZE,
            "residual": self.residual,
            "numerics": self.numerics,
        }


def unrepresentable(config: dict, numeric_path: str, dtype: str, session_id: str) -> str | None:
    """Why a session with this pipeline config cannot be a compact file (None: it can)."""
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
    if id_problem(session_id):
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
    reason = unrepresentable(
        session.pipeline_config(), session.numeric_path, session.dtype, session.session_id
    )
    if reason or len(session.fingerprint) != FINGERPRINT_HEX:
        raise InvalidContainerInputError("<compact>", f"not a compact session: {reason}")
    pipeline = (
        CODECS.index(session.codec)
        | RESIDUALS.index(session.residual) << 1
        | NUMERICS.index(session.numerics) << 2
    )
    kinds = DTYPES.index(session.dtype) | CAPTURE_PATHS.index(session.numeric_path) << 4
    minor = max(minor_of(session.numerics), minor_of(session.numeric_path))
    head = bytearray(
        FIXED_HEADER.pack(
            MAGIC,
            FORMAT_MAJOR,
            minor,
            LAYOUT_COMPACT,
            pipeline,
            bytes.fromhex(session.fingerprint),
            kinds,
        )
    )
    for value in (session.num_layers, session.num_kv_heads, session.head_dim, session.positions):
        head += encode_varint(value)
    head += struct.pack("<HH", session.log2_ppl_milli, session.token_check)
    name = session.session_id.encode("utf-8")
    head += encode_varint(len(name)) + name + encode_varint(len(payload))
    head += crc32c(bytes(head)).to_bytes(4, "little")
    return bytes(head) + payload + crc32c(payload).to_bytes(4, "little")


def write_compact(path: str | os.PathLike[str], session: CompactSession, payload: bytes) -> int:
    """Write the file atomically (temporary sibling, fsync, rename, fsync the directory)."""
    path = os.fspath(path)
    data = encode_compact(session, payload)
    try:
        with atomic_path(Path(path)) as tmp, open(tmp, "xb") as file:
            file.write(data)
    except PublishError as error:
        raise ContainerWriteError(path, f"cannot write: {error.reason}") from None
    except OSError as error:
        raise ContainerWriteError(path, f"cannot write: {describe_os_error(error)}") from None
    return len(data)


def is_compact(head: bytes) -> bool:
    """Whether the first bytes of a file (magic checked by the caller) are this layout's."""
    return (
        len(head) > 12
        and int.from_bytes(head[8:10], "little") == FORMAT_MAJOR
        and int.from_bytes(head[10:12], "little") >= COMPACT_MINOR
        and head[12] == LAYOUT_COMPACT
    )


def minor_of(path: str) -> int:
    return PATH_MINOR.get(path, COMPACT_MINOR)
