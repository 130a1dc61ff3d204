"""The Python library API (docs/API.md): a thin face over the archive package for a Python
user's own sessions.

`open_archive` opens (or, on the first `add`, creates) a trie archive of one model's sessions
(`MemoryArchive`: add, add_many, load, sessions, meta, schedule; what it hands back:
`SessionInfo`, `AddReport`); `compress_sessions` writes many sessions given as token ids in
one go. What they are given is checked here, before any model work (arguments.py); the work
itself is `seqkv_cli.archive`'s.
"""

from seqkv_cli.api.arguments import check_meta
from seqkv_cli.api.memory import MemoryArchive, open_archive
from seqkv_cli.api.reports import AddReport, SessionInfo
from seqkv_cli.api.sessions import compress_sessions, session_codec

__all__ = [
    "AddReport",
    "MemoryArchive",
    "SessionInfo",
    "check_meta",
    "compress_sessions",
    "open_archive",
    "session_codec",
]
