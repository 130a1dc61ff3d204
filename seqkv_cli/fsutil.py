"""Small filesystem checks shared by commands that write files."""

from __future__ import annotations

import os
from pathlib import Path

from seqkv_cli.errors import SeqkvError


def ensure_writable_dir(folder: Path) -> None:
    """Create `folder` if needed and refuse early, in one line, if nothing can be written there."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SeqkvError(f"cannot create output directory {folder}: {exc.strerror}") from None
    if not os.access(folder, os.W_OK):
        raise SeqkvError(f"output directory {folder} is not writable")
