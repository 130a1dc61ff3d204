"""Reading a compact single-session file (format 1.2+, docs/FORMAT.md): its header checked
field by field (shapes, codes the file's minor may hold, the session id) before any byte of
the payload is trusted. The layout and the writer are in `container.compact`."""

from __future__ import annotations

import os
import struct
from typing import Any

from seqkv_cli.container.compact import (
    CAPTURE_PATHS,
    CODECS,
    DTYPES,
    FIXED_HEADER,
    MAX_HEADER_BYTES,
    MAX_POSITIONS,
    MAX_SHAPE,
    NUMERICS,
    RESIDUALS,
    TOKENS_SECTION,
    CompactSession,
    id_problem,
    minor_of,
)
from seqkv_cli.container.errors import (
    ContainerError,
    CorruptContainerError,
    MalformedContainerError,
    SectionCorruptError,
    SectionNotFoundError,
    TruncatedContainerError,
    UnsupportedVersionError,
)
from seqkv_cli.container.format import (
    FORMAT_MINOR,
    VarintError,
    crc32c,
    decode_varint,
)
from seqkv_cli.container.index import SectionEntry
from seqkv_cli.container.openfile import OpenFile


class _Fields:
    """Bounded parsing of the header bytes; running past them means the file is truncated."""

    def __init__(self, path: str, data: bytes, pos: int) -> None:
        self.path, self.data, self.pos = path, data, pos

    def truncated(self) -> ContainerError:
        return TruncatedContainerError(self.path, "the file ends inside its compact header")

    def varint(self) -> int:
        try:
            value, self.pos = decode_varint(self.data, self.pos, 10)
        except VarintError as error:
            if error.truncated:
                raise self.truncated() from None
            raise MalformedContainerError(
                self.path, "a number in the compact header is too long"
            ) from None
        return value

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise self.truncated()
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out


class CompactReader(OpenFile):
    """A validated compact file, read through the same surface as ContainerReader.

    It presents itself as a one-segment trie archive whose tables are `compact` (a
    CompactSession) and whose one section is the token payload, `t1/tokens`.
    """

    generation = 1
    damaged_slots: tuple[int, ...] = ()
    uncommitted_bytes = 0

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__(path)
        try:
            self._parse(self._file.read(MAX_HEADER_BYTES))
        except BaseException:
            self._file.close()
            raise

    def _parse(self, head: bytes) -> None:
        if len(head) < FIXED_HEADER.size:
            raise TruncatedContainerError(self.path, "the file ends inside its compact header")
        _, major, minor, _, pipeline, fingerprint, kinds = FIXED_HEADER.unpack_from(head)
        self.version = (major, minor)
        if minor > FORMAT_MINOR:  # a newer minor may add fields this parser does not know
            raise UnsupportedVersionError(
                self.path, f"written by a newer seqkv (format {major}.{minor}); upgrade seqkv"
            )
        fields = _Fields(self.path, head, FIXED_HEADER.size)
        layers, heads, head_dim, positions = (fields.varint() for _ in range(4))
        ppl, check = struct.unpack("<HH", fields.take(4))
        name = fields.take(fields.varint())
        length = fields.varint()
        end = fields.pos
        stored = int.from_bytes(fields.take(4), "little")
        if crc32c(head[:end]) != stored:
            raise CorruptContainerError(self.path, "the compact header's checksum does not match")
        self.header_bytes = end + 4
        if self.size < self.header_bytes + length + 4:
            raise TruncatedContainerError(
                self.path,
                f"truncated: {self.size} bytes, but the header promises "
                f"{self.header_bytes + length + 4}; copy the file again",
            )
        if self.size > self.header_bytes + length + 4:
            raise MalformedContainerError(
                self.path, f"{self.size - self.header_bytes - length - 4} bytes after its end"
            )
        bad = _bad_codes(pipeline, kinds, minor)
        if bad:
            raise MalformedContainerError(self.path, f"invalid compact header: {bad}")
        try:
            session_id = name.decode("utf-8")
        except UnicodeDecodeError:
            raise MalformedContainerError(self.path, "its session id is not UTF-8") from None
        problem = id_problem(session_id)
        if problem:
            raise MalformedContainerError(self.path, f"its session id is {problem}")
        if not (
            1 <= layers <= MAX_SHAPE and 1 <= heads <= MAX_SHAPE and 1 <= head_dim <= MAX_SHAPE
        ):
            raise MalformedContainerError(
                self.path, f"impossible shape ({layers} layers, {heads} heads, dim {head_dim})"
            )
        if not 1 <= positions < MAX_POSITIONS:
            raise MalformedContainerError(self.path, f"impossible length ({positions} positions)")
        self.compact = CompactSession(
            codec=CODECS[pipeline & 1],
            residual=RESIDUALS[pipeline >> 1 & 1],
            numerics=NUMERICS[pipeline >> 2 & 3],
            fingerprint=fingerprint.hex(),
            session_id=session_id,
            positions=positions,
            dtype=DTYPES[kinds & 0xF],
            numeric_path=CAPTURE_PATHS[kinds >> 4],
            num_layers=layers,
            num_kv_heads=heads,
            head_dim=head_dim,
            log2_ppl_milli=ppl,
            token_check=check,
        )
        self._payload_crc: int | None = None
        self._entry = SectionEntry(TOKENS_SECTION, self.header_bytes, length, 0)

    @property
    def header(self) -> dict[str, Any]:
        """The header a full trie archive of this session would have (no capture metadata)."""
        return {
            "pipeline": [self.compact.pipeline_config()],
            "model": {"fingerprint": self.compact.fingerprint},
            "sessions": [],
            "meta": {},
            "trie": {"version": 1},
        }

    @property
    def index_bytes(self) -> int:
        """Framing bytes: the header with its CRC32C and the payload's CRC32C."""
        return self.header_bytes + 4

    @property
    def sections(self) -> list[SectionEntry]:
        entry = self._entry
        return [SectionEntry(entry.name, entry.offset, entry.length, self._crc())]

    def _crc(self) -> int:
        if self._payload_crc is None:
            self._payload_crc = int.from_bytes(
                self._read_at(self._entry.offset + self._entry.length, 4), "little"
            )
        return self._payload_crc

    def read_section(self, name: str) -> bytes:
        if name != TOKENS_SECTION:
            raise SectionNotFoundError(
                self.path, f"no section named {name!r} (a compact file has only {TOKENS_SECTION})"
            )
        data = self._read_at(self._entry.offset, self._entry.length)
        if crc32c(data) != self._crc():
            raise SectionCorruptError(
                self.path, name, "the token payload is corrupt (checksum mismatch)"
            )
        return data

    def verify(self) -> None:
        self.read_section(TOKENS_SECTION)


def _bad_codes(pipeline: int, kinds: int, minor: int) -> str | None:
    if pipeline >> 4 or (pipeline >> 2 & 3) >= len(NUMERICS):
        return f"unknown pipeline bits 0x{pipeline:02x}"
    if (kinds & 0xF) >= len(DTYPES):
        return f"unknown dtype code {kinds & 0xF}"
    if kinds >> 4 >= len(CAPTURE_PATHS):
        return f"unknown capture numeric path code {kinds >> 4}"
    for path in (NUMERICS[pipeline >> 2 & 3], CAPTURE_PATHS[kinds >> 4]):
        since = minor_of(path)
        if minor < since:
            return f"numeric path {path} in a format 1.{minor} file (its codes came in 1.{since})"
    return None
