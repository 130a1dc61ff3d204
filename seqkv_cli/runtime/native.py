"""The one switch for seqkv's native (numba) kernels: on where numba imports, off by
``SEQKV_PORTABLE_KERNELS=reference`` or inside `reference()`; and where it is read.

A function of a definition (the portable numerics' `exact` and `elementary`) is written as
its torch reference alone and marked `definition`; a kernel module registers a `twin` for it
(the same bits, faster). A call runs the twin where the switch is on and the twin takes the
arguments, else the reference: the definition reads on its own, and this switch is the one
place that chooses.

The kernels compute the same bits as their references (torch for the portable definition,
gguf-py for stored weights), so the switch changes speed, never results; it exists so that a
machine where a kernel misbehaves can still code and decode, and so that tests can compare
both. numba is imported on first use only: `seqkv --help` never pays for it.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable

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


_twins: dict[Callable, Callable] = {}  # a definition's reference -> its native twin


def definition(reference_fn: Callable) -> Callable:
    """Marks a function of a definition: its body is the reference; a registered `twin`
    computes the same bits where the switch is on (and returns NotImplemented for arguments
    it does not take: a GPU tensor, another shape)."""

    @functools.wraps(reference_fn)
    def run(*args, **kwargs):
        twin = _twins.get(reference_fn)
        if twin is not None and enabled():
            out = twin(*args, **kwargs)
            if out is not NotImplemented:
                return out
        return reference_fn(*args, **kwargs)

    run.reference = reference_fn  # the definition's own body, for tests and the canary
    return run


def twin(defined: Callable) -> Callable[[Callable], Callable]:
    """Registers the decorated function as the native twin of `defined` (a `definition`)."""

    def register(fn: Callable) -> Callable:
        _twins[defined.reference] = fn
        return fn

    return register
