"""Reading compact files (docs/FORMAT.md): a single-session file (format 1.2+) or a compact
archive (1.8+), its header checked field by field (shapes, codes the file's minor may hold, the
session id) before any byte of the payload is trusted. The layouts and the writers are in
`container.compact`; what a compact archive's table says is checked by the trie's reader."""

from __future__ import annotations

import os
import struct
import zlib
from typing import Any

from seqkv_cli.container.compact import (
    ARCHIVE_MINOR,
    ARCHIVE_SECTION,
    CAPTURE_PATHS,
    CODECS,
    DTYPES,
    FIXED_HEADER,
    LAYOUT_ARCHIVE,
    MAX_HEADER_BYTES,
    MAX_POSITIONS,
    MAX_SHAPE,
    NUMERICS,
    RESIDUALS,
    TOKENS_SECTION,
    CompactProfile,
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
    MAX_INDEX_BYTES,
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

    It presents itself as a one-segment trie archive. A single-session file's tables are
    `compact` (a CompactSession) and its one section is the token payload, `t1/tokens`; a
    compact archive's `compact` is the CompactProfile its sessions share (`archive` is true)
    and its one section, `t1/index`, is its segment table, inflated, followed by its tokens:
    what a version-2 segment holds in the full layout.
    """

    generation = 1
    archive = False  # a compact archive (else a single-session file); set by the parser
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
        _, major, minor, layout, pipeline, fingerprint, kinds = FIXED_HEADER.unpack_from(head)
        self.version = (major, minor)
        self.archive = layout == LAYOUT_ARCHIVE
        if minor > FORMAT_MINOR:  # a newer minor may add fields this parser does not know
            raise UnsupportedVersionError(
                self.path, f"written by a newer seqkv (format {major}.{minor}); upgrade seqkv"
            )
        if self.archive and minor < ARCHIVE_MINOR:
            raise MalformedContainerError(
                self.path, f"a compact archive in a format 1.{minor} file (they came in 1.8)"
            )
        fields = _Fields(self.path, head, FIXED_HEADER.size)
        layers, heads, head_dim = (fields.varint() for _ in range(3))
        if self.archive:
            table, length = fields.varint(), fields.varint()
        else:
            positions = fields.varint()
            ppl, check = struct.unpack("<HH", fields.take(4))
            name = fields.take(fields.varint())
            table, length = 0, fields.varint()
        end = fields.pos
        stored = int.from_bytes(fields.take(4), "little")
        if crc32c(head[:end]) != stored:
            raise CorruptContainerError(self.path, "the compact header's checksum does not match")
        self.header_bytes = end + 4
        body = table + length
        if self.size < self.header_bytes + body + 4:
            raise TruncatedContainerError(
                self.path,
                f"truncated: {self.size} bytes, but the header promises "
                f"{self.header_bytes + body + 4}; copy the file again",
            )
        if self.size > self.header_bytes + body + 4:
            raise MalformedContainerError(
                self.path, f"{self.size - self.header_bytes - body - 4} bytes after its end"
            )
        bad = _bad_codes(pipeline, kinds, minor)
        if bad:
            raise MalformedContainerError(self.path, f"invalid compact header: {bad}")
        if not (
            1 <= layers <= MAX_SHAPE and 1 <= heads <= MAX_SHAPE and 1 <= head_dim <= MAX_SHAPE
        ):
            raise MalformedContainerError(
                self.path, f"impossible shape ({layers} layers, {heads} heads, dim {head_dim})"
            )
        profile = dict(
            codec=CODECS[pipeline & 1],
            residual=RESIDUALS[pipeline >> 1 & 1],
            numerics=NUMERICS[pipeline >> 2 & 3],
            fingerprint=fingerprint.hex(),
            dtype=DTYPES[kinds & 0xF],
            numeric_path=CAPTURE_PATHS[kinds >> 4],
            num_layers=layers,
            num_kv_heads=heads,
            head_dim=head_dim,
        )
        self._payload_crc: int | None = None
        self.table_bytes, self.payload_bytes = table, length
        if self.archive:
            if table == 0:
                raise MalformedContainerError(self.path, "its session table is empty")
            self.compact: CompactProfile = CompactProfile(**profile)
            self._entry = SectionEntry(ARCHIVE_SECTION, self.header_bytes, body, 0)
            return
        try:
            session_id = name.decode("utf-8")
        except UnicodeDecodeError:
            raise MalformedContainerError(self.path, "its session id is not UTF-8") from None
        problem = id_problem(session_id)
        if problem:
            raise MalformedContainerError(self.path, f"its session id is {problem}")
        if not 1 <= positions < MAX_POSITIONS:
            raise MalformedContainerError(self.path, f"impossible length ({positions} positions)")
        self.compact = CompactSession(
            **profile,
            session_id=session_id,
            positions=positions,
            log2_ppl_milli=ppl,
            token_check=check,
        )
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
        entry = self._entry
        if name != entry.name:
            raise SectionNotFoundError(
                self.path, f"no section named {name!r} (a compact file has only {entry.name})"
            )
        data = self._read_at(entry.offset, entry.length)
        if crc32c(data) != self._crc():
            what = "session table or token payload" if self.archive else "token payload"
            raise SectionCorruptError(self.path, name, f"the {what} is corrupt (checksum mismatch)")
        if not self.archive:
            return data
        return self._inflated(data[: self.table_bytes]) + data[self.table_bytes :]

    def _inflated(self, packed: bytes) -> bytes:
        """The session table, refused as soon as it would inflate past the index cap (a
        deflate bomb with a valid checksum stops there)."""
        inflater = zlib.decompressobj(-15)
        try:
            table = inflater.decompress(packed, MAX_INDEX_BYTES + 1)
        except zlib.error:
            raise MalformedContainerError(self.path, "its session table does not inflate") from None
        if len(table) > MAX_INDEX_BYTES:
            raise MalformedContainerError(
                self.path, f"its session table inflates past {MAX_INDEX_BYTES} bytes"
            )
        if not inflater.eof or inflater.unused_data or inflater.unconsumed_tail:
            raise MalformedContainerError(
                self.path, "its session table does not end where its header says"
            )
        return table

    def verify(self) -> None:
        self.read_section(self._entry.name)


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
