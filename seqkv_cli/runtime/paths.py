"""Where seqkv keeps what it downloads and converts."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """`SEQKV_CACHE` if set, else the platform's user cache dir (e.g. ~/.cache/seqkv)."""
    env = os.environ.get("SEQKV_CACHE")
    if env:
        return Path(env).expanduser()
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("seqkv", appauthor=False))
