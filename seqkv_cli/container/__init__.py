"""The `.skv` container: a checksummed, appendable, self-describing file of named sections.

Byte layout and version rules: docs/FORMAT.md. This package uses only the standard library,
google-crc32c and `seqkv_cli.errors`, so opening a container never imports torch.
"""

from seqkv_cli.container.append import append_sessions, locked_for_append
from seqkv_cli.container.errors import (
    ContainerError,
    ContainerWriteError,
    CorruptContainerError,
    HeaderTooLargeError,
    InvalidContainerInputError,
    MalformedContainerError,
    NotAContainerError,
    SectionCorruptError,
    SectionNotFoundError,
    TruncatedContainerError,
    UnsupportedVersionError,
)
from seqkv_cli.container.format import FORMAT_MAJOR, FORMAT_MINOR, MAX_INDEX_BYTES
from seqkv_cli.container.index import SectionEntry
from seqkv_cli.container.reader import ContainerReader, open_container
from seqkv_cli.container.writer import ContainerWriter, WriteResult, write_container

__all__ = [
    "FORMAT_MAJOR",
    "FORMAT_MINOR",
    "MAX_INDEX_BYTES",
    "ContainerError",
    "ContainerReader",
    "ContainerWriteError",
    "ContainerWriter",
    "CorruptContainerError",
    "HeaderTooLargeError",
    "InvalidContainerInputError",
    "MalformedContainerError",
    "NotAContainerError",
    "SectionCorruptError",
    "SectionEntry",
    "SectionNotFoundError",
    "TruncatedContainerError",
    "UnsupportedVersionError",
    "WriteResult",
    "append_sessions",
    "locked_for_append",
    "open_container",
    "write_container",
]
