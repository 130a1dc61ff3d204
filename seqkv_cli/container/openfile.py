"""An `.skv` file open for reading: the part both layouts' readers share."""

from __future__ import annotations

import os
from contextlib import AbstractContextManager
from typing import BinaryIO

from seqkv_cli.container.errors import ContainerError, TruncatedContainerError


class OpenFile(AbstractContextManager):
    """Opens `path` (one clear line if it cannot) and reads exact byte ranges from it."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        try:
            self._file: BinaryIO = open(self.path, "rb")  # noqa: SIM115 - closed by close()
        except OSError as error:
            raise ContainerError(self.path, f"cannot open ({error.strerror})") from None
        try:
            self.size = os.fstat(self._file.fileno()).st_size
        except BaseException:
            self._file.close()
            raise

    def _read_at(self, offset: int, length: int) -> bytes:
        """Read exactly `length` bytes; a short read means the file shrank under us."""
        self._file.seek(offset)
        data = self._file.read(length)
        if len(data) != length:
            raise TruncatedContainerError(
                self.path, f"truncated: wanted {length} bytes at offset {offset}"
            )
        return data

    def close(self) -> None:
        self._file.close()

    def __exit__(self, *exc_info: object) -> None:
        self.close()
