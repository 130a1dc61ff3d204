"""Add sessions to an existing `.skv` file without rewriting a byte of what it holds.

Crash safety comes from ordering: new sections and a new index go *after* the committed end
and are fsynced; only then is the spare superblock slot rewritten to point at the new index.
Killed before that slot write, the file still opens at its old state (readers ignore the
uncommitted tail, and the next append truncates it); killed after, it opens at the new one.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any, BinaryIO

from seqkv_cli.container.compact import is_compact
from seqkv_cli.container.compact_reader import CompactReader
from seqkv_cli.container.errors import (
    ContainerWriteError,
    InvalidContainerInputError,
    UnsupportedVersionError,
)
from seqkv_cli.container.format import (
    FORMAT_MINOR,
    PREAMBLE,
    SLOT_OFFSETS,
    Slot,
    crc32c,
    encode_slot,
)
from seqkv_cli.container.index import IndexRecord, Region
from seqkv_cli.container.reader import ContainerReader
from seqkv_cli.container.writer import Buffer, SectionSink, WriteResult, write_container
from seqkv_cli.fsutil import checkpoint, describe_os_error

# Appends are serialised with flock. Windows has no fcntl module: there, `archive add` and
# `archive compact` refuse with one line (ContainerWriteError) rather than append unlocked,
# since two unlocked appenders would truncate each other's committed segment and silently
# lose one add. Reading, compress and decompress do not lock and work everywhere.
try:
    import fcntl
except ImportError:
    fcntl = None  # type: ignore[assignment]


def append_sessions(
    path: str | os.PathLike[str],
    sessions: list[dict[str, Any]],
    sections: Iterable[tuple[str, Buffer]],
) -> WriteResult:
    """Append `sections` and register `sessions` in the header; returns the new sizes.

    The file's pipeline, model and meta are kept; new session ids and section names must
    not clash with existing ones. Concurrent appenders are serialised with flock.
    """
    with locked_for_append(path) as appender:
        return appender.commit(sessions, sections)


class Appender:
    """An open, exclusively locked container: read what it holds, then commit one segment.

    A compact single-session file (format 1.2) has no room for segments: `compact` is true,
    `commit` refuses, and `rewrite` replaces it with a full-layout file first.
    """

    def __init__(self, file: BinaryIO, current: ContainerReader | CompactReader) -> None:
        self.file, self.current = file, current

    @property
    def reader(self) -> ContainerReader | CompactReader:
        return self.current

    @property
    def compact(self) -> bool:
        return isinstance(self.current, CompactReader)

    def rewrite(self, header: dict[str, Any], sections: Iterable[tuple[str, Buffer]]) -> int:
        """Replace the locked file with a full-layout one (atomically, under the lock).

        Appenders waiting for the lock notice the replacement and lock the new file, so
        nothing they add is lost; the caller locks it again to append (its size returned).
        """
        return write_container(self.current.path, header, sections).file_bytes

    def commit(
        self, sessions: list[dict[str, Any]], sections: Iterable[tuple[str, bytes]]
    ) -> WriteResult:
        if self.compact:
            raise InvalidContainerInputError(
                self.current.path, "a compact single-session file takes no appends; rewrite it"
            )
        if not isinstance(sessions, list):
            raise InvalidContainerInputError(
                self.current.path, "sessions must be a list of session dicts"
            )
        try:
            return _append(self.file, self.current, sessions, sections)
        except OSError as error:
            raise ContainerWriteError(
                self.current.path, f"cannot append: {describe_os_error(error)}"
            ) from error


@contextlib.contextmanager
def locked_for_append(
    path: str | os.PathLike[str], on_wait: Callable[[], None] | None = None
) -> Iterator[Appender]:
    """Hold the file's append lock while the caller reads, encodes and commits.

    A second appender waits (after `on_wait()` tells the user why) rather than failing, so
    two `archive add` runs are serialised and the second sees the first's sessions.
    """
    path = os.fspath(path)
    file = _open_locked(path, on_wait)
    try:
        file.seek(0)
        if is_compact(file.read(PREAMBLE.size)):
            with CompactReader(path) as compact:
                yield Appender(file, compact)
            return
        with ContainerReader(path) as current:
            major, minor = current.version
            if minor > FORMAT_MINOR:
                raise UnsupportedVersionError(
                    path, f"written by a newer seqkv (format {major}.{minor}); upgrade seqkv"
                )
            yield Appender(file, current)
    except OSError as error:
        raise ContainerWriteError(path, f"cannot append: {describe_os_error(error)}") from error
    finally:
        # a commit flushed and fsynced what it wrote; what a failed write left in the buffer
        # lies past the committed end, and a full disk refusing it again here must not hide
        # the error that led here
        with contextlib.suppress(OSError):
            file.close()


def _open_locked(path: str, on_wait) -> BinaryIO:
    """Open and lock `path`; if it was replaced while we waited (compact), lock the new file."""
    while True:
        try:
            file = open(path, "r+b")  # noqa: SIM115 - the caller closes it
        except OSError as error:
            raise ContainerWriteError(path, f"cannot append: {describe_os_error(error)}") from None
        if fcntl is None:
            file.close()
            raise ContainerWriteError(
                path,
                "cannot lock for append: this platform has no flock (fcntl), so appending "
                "could lose a concurrent writer's sessions; add or compact on Linux or macOS",
            )
        try:
            try:
                fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if on_wait is not None:
                    on_wait()
                    on_wait = None
                fcntl.flock(file.fileno(), fcntl.LOCK_EX)
            if os.fstat(file.fileno()).st_ino == os.stat(path).st_ino:
                return file
        except OSError:
            file.close()
            raise
        file.close()


def _append(
    file: BinaryIO,
    current: ContainerReader,
    sessions: list[dict[str, Any]],
    sections: Iterable[tuple[str, Buffer]],
) -> WriteResult:
    """Write segment and index past the committed end, fsync, then flip the spare slot."""
    slot = current.slot
    checkpoint("truncate", current.path)
    file.truncate(slot.committed_end)  # drop what an interrupted append may have left
    try:
        sink = SectionSink(
            current.path, file, slot.committed_end, (s.name for s in current.sections)
        )
        for name, data in sections:
            sink.add(name, data)
        previous = Region(slot.index_offset, slot.index_length, slot.index_crc)
        record = IndexRecord(slot.generation + 1, previous, None, sessions, tuple(sink.entries))
        old = current.header
        merged = dict(old, sessions=[*old["sessions"], *sessions])
        raw = sink.encode_record(record, merged, strict=False, layout=current.layout)
        checkpoint("write", current.path)
        file.seek(sink.offset)
        file.write(raw)
        checkpoint("flush", current.path)
        file.flush()
        checkpoint("fsync", current.path)
        os.fsync(file.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            file.truncate(slot.committed_end)
        raise
    new = Slot(1 - slot.number, record.generation, sink.offset, len(raw), crc32c(raw))
    checkpoint("commit", current.path)
    file.seek(SLOT_OFFSETS[new.number])
    file.write(encode_slot(current.preamble, new))  # the commit point
    file.flush()
    checkpoint("fsync", current.path)
    os.fsync(file.fileno())
    section_bytes = sum(entry.length for entry in sink.entries)
    return WriteResult(current.path, new.generation, new.committed_end, section_bytes, len(raw))
