"""Errors for `.skv` files: one class per thing that can be wrong, one line per message.

Every message starts with the file path so that a CLI printing `str(error)` tells the user
which file is bad, what is wrong with it and, where there is one, the fix.
"""

from __future__ import annotations

import os

from seqkv_cli.errors import SeqkvError


class ContainerError(SeqkvError):
    """Base class: something is wrong with an `.skv` file or with what was asked of it."""

    def __init__(self, path: str | os.PathLike[str], problem: str) -> None:
        self.path = os.fspath(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


class NotAContainerError(ContainerError):
    """The file does not start with the `.skv` magic bytes (or is shorter than them)."""


class UnsupportedVersionError(ContainerError):
    """The file uses a format major version this seqkv cannot read."""


class TruncatedContainerError(ContainerError):
    """The file ends before the data its superblock committed to."""


class HeaderTooLargeError(ContainerError):
    """The index (JSON header) is larger than the cap readers and writers accept."""


class CorruptContainerError(ContainerError):
    """A checksum does not match, or the committed structure contradicts itself."""


class MalformedContainerError(CorruptContainerError):
    """The index passed its checksum but is not a valid index (bad JSON, bounds, holes...)."""


class SectionCorruptError(CorruptContainerError):
    """One section's payload does not match its checksum; `section` names it."""

    def __init__(self, path: str | os.PathLike[str], section: str, problem: str) -> None:
        self.section = section
        super().__init__(path, problem)


class SectionNotFoundError(ContainerError, LookupError):
    """A section name that the file does not hold was requested."""


class InvalidContainerInputError(ContainerError, ValueError):
    """The caller handed the writer something that cannot be stored (bad header, names...)."""


class ContainerWriteError(ContainerError):
    """The operating system refused the write (missing directory, permissions, disk full)."""
