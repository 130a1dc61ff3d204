"""The one switch for seqkv's native (numba) kernels: on where numba imports, off by
``SEQKV_PORTABLE_KERNELS=reference`` or inside `reference()`.

The kernels compute the same bits as their references (torch for the portable definition,
gguf-py for stored weights), so the switch changes speed, never results; it exists so that a
machine where a kernel misbehaves can still code and decode, and so that tests can compare
both. numba is imported on first use only: `seqkv --help` never pays for it.
"""

from __future__ import annotations

import contextlib
import functools
import os

ENV = "SEQKV_PORTABLE_KERNELS"
_forced_reference = False  # set by `reference()`


def enabled() -> bool:
    """Whether the native kernels run (numba importable and not turned off by `ENV`)."""
    if _forced_reference or os.environ.get(ENV, "native") == "reference":
        return False
    return numba() is not None


@contextlib.contextmanager
def reference():
    """Within it, every kernel's reference runs instead (to compare the kernels with it)."""
    global _forced_reference
    saved, _forced_reference = _forced_reference, True
    try:
        yield
    finally:
        _forced_reference = saved


@functools.cache
def numba():
    """The numba module, or None where it is not installed."""
    try:
        import numba
    except ImportError:  # an optional speed-up: the references give the same bits
        return None
    return numba
