"""Write a whole `.skv` file atomically, streaming sections so none must sit in memory.

Sections go to a temporary file in the target directory; only after the index and the
superblock are written does `fsutil.publish` (fsync, rename, fsync the directory) put the file
in place. Any error on the way deletes the temporary file, so a failed write leaves nothing
behind.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO

from seqkv_cli.container.errors import (
    ContainerWriteError,
    HeaderTooLargeError,
    InvalidContainerInputError,
)
from seqkv_cli.container.format import (
    LAYOUT_JSON,
    LAYOUT_RECORDS,
    MAX_INDEX_BYTES,
    SUPERBLOCK_SIZE,
    Slot,
    crc32c,
    encode_superblock,
)
from seqkv_cli.container.index import IndexRecord, SectionEntry, encode_record
from seqkv_cli.container.schema import SchemaViolation, check_header, check_section_name
from seqkv_cli.fsutil import (
    PublishError,
    checkpoint,
    describe_os_error,
    discard_quietly,
    publish,
    staging_name,
)

Buffer = bytes | bytearray | memoryview  # or any C-contiguous buffer, e.g. a numpy array


@dataclass(frozen=True)
class WriteResult:
    """Sizes of what was written, for reports that split payload from overhead.

    `section_bytes` and `index_bytes` count what this write (or append) added;
    `file_bytes` is the size of the whole file afterwards.
    """

    path: str
    generation: int
    file_bytes: int
    section_bytes: int
    index_bytes: int


class SectionSink:
    """Streams sections to the end of an open file, remembering where each one landed."""

    def __init__(self, path: str, file: BinaryIO, offset: int, taken: Iterable[str]) -> None:
        self.path, self.file, self.offset = path, file, offset
        self.taken = set(taken)
        self.entries: list[SectionEntry] = []

    def add(self, name: str, data: Buffer) -> SectionEntry:
        try:
            check_section_name(name)
        except SchemaViolation as error:
            raise InvalidContainerInputError(self.path, str(error)) from None
        if name in self.taken:
            raise InvalidContainerInputError(
                self.path, f"section name {name!r} is used twice; names must be unique"
            )
        try:
            view = memoryview(data).cast("B")
        except TypeError:
            raise InvalidContainerInputError(
                self.path, f"section {name!r} must be contiguous bytes, not {type(data).__name__}"
            ) from None
        checkpoint("write", self.path)
        self.file.seek(self.offset)
        self.file.write(view)
        entry = SectionEntry(
            name, self.offset, len(view), crc32c(data if type(data) is bytes else view)
        )
        self.taken.add(name)
        self.entries.append(entry)
        self.offset += entry.length
        return entry

    def encode_record(
        self, record: IndexRecord, header: dict[str, Any], strict: bool, layout: int
    ) -> bytes:
        """Check `header` (the merged one) against every section name, then serialise."""
        try:
            check_header(header, self.taken, strict=strict)
            raw = encode_record(record, layout)
        except SchemaViolation as error:
            raise InvalidContainerInputError(self.path, str(error)) from None
        if len(raw) > MAX_INDEX_BYTES:
            raise HeaderTooLargeError(
                self.path, f"the index would be {len(raw)} bytes, over the {MAX_INDEX_BYTES} cap"
            )
        return raw


class ContainerWriter:
    """`add_section()` any number of times, then `finish(header)`; use it in a `with` block.

    `tables=False` writes a format 1.1 file (JSON section tables), which seqkv before 0.4
    reads and appends to; the default, 1.6, is ~75 bytes a section smaller, and each append to
    it ~100 bytes smaller again. `layout` names another encoding (format.LAYOUT_*): the tests
    write 1.4 files with it, as seqkv 0.4-0.5 did."""

    def __init__(
        self, path: str | os.PathLike[str], tables: bool = True, layout: int | None = None
    ) -> None:
        self.path = os.fspath(path)
        self.layout = (LAYOUT_RECORDS if tables else LAYOUT_JSON) if layout is None else layout
        try:  # the staging name removes what writers killed mid-write left beside it
            self._tmp = os.fspath(staging_name(Path(self.path)))
            fd = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except OSError as error:
            raise ContainerWriteError(
                self.path, f"cannot write: {describe_os_error(error)}"
            ) from None
        self._file: BinaryIO | None = os.fdopen(fd, "wb")
        self._sink = SectionSink(self.path, self._file, SUPERBLOCK_SIZE, ())
        with self._guard():
            self._file.write(bytes(SUPERBLOCK_SIZE))  # placeholder until finish()

    def add_section(self, name: str, data: Buffer) -> SectionEntry:
        """Append one section to the temporary file; its bytes are not kept in memory."""
        with self._guard():
            return self._sink.add(name, data)

    def finish(self, header: dict[str, Any]) -> WriteResult:
        """Write index and superblock, fsync, and move the file into place."""
        with self._guard():
            file = self._live_file()
            record = IndexRecord(1, None, header, [], tuple(self._sink.entries))
            raw = self._sink.encode_record(record, header, strict=True, layout=self.layout)
            offset = self._sink.offset
            checkpoint("write", self._tmp)
            file.seek(offset)
            file.write(raw)
            file.seek(0)
            slot = Slot(0, 1, offset, len(raw), crc32c(raw))
            file.write(encode_superblock(slot, self.layout))
            checkpoint("flush", self._tmp)
            file.flush()
            checkpoint("close", self._tmp)
            file.close()
            self._file = None
            try:
                publish(Path(self._tmp), Path(self.path))  # fsync, rename, fsync the directory
            except PublishError as error:
                raise ContainerWriteError(self.path, f"cannot write: {error.reason}") from None
        section_bytes = sum(entry.length for entry in self._sink.entries)
        return WriteResult(self.path, 1, offset + len(raw), section_bytes, len(raw))

    def abort(self) -> None:
        """Close and delete the temporary file; safe to call more than once, and it never
        raises: on a full disk the close fails again (flushing what is buffered), and that
        must not replace the error that led here with a traceback."""
        file, self._file = self._file, None
        if file is not None:
            with contextlib.suppress(OSError):  # a failed flush still closes the descriptor
                checkpoint("close", self._tmp)
                file.close()
        discard_quietly(Path(self._tmp))

    def _live_file(self) -> BinaryIO:
        if self._file is None:
            raise ContainerWriteError(self.path, "the writer is already finished or aborted")
        return self._file

    @contextlib.contextmanager
    def _guard(self) -> Iterator[None]:
        """Any failure aborts the write, so no temporary file outlives an error."""
        self._live_file()
        try:
            yield
        except OSError as error:
            self.abort()
            raise ContainerWriteError(
                self.path, f"cannot write: {describe_os_error(error)}"
            ) from error
        except BaseException:
            self.abort()
            raise

    def __enter__(self) -> ContainerWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        unfinished = self._file is not None
        self.abort()
        if unfinished and exc_type is None:
            raise ContainerWriteError(self.path, "finish(header) was never called; nothing written")


def write_container(
    path: str | os.PathLike[str],
    header: dict[str, Any],
    sections: Iterable[tuple[str, Buffer]],
    tables: bool = True,
    layout: int | None = None,
) -> WriteResult:
    """Write `sections` (streamed from any iterable) and `header` to `path` atomically."""
    with ContainerWriter(path, tables, layout) as writer:
        for name, data in sections:
            writer.add_section(name, data)
        return writer.finish(header)
