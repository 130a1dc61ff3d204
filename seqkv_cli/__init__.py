"""seqkv: capture, compress, restore and report transformer KV caches.

Heavy modules (torch, transformers) load only when an API function is first called, so that
`seqkv --help` stays fast.
"""

from seqkv_cli.version import __version__

__all__ = ["__version__", "capture", "load_capture", "to_dynamic_cache"]


def capture(inputs, **options):
    """Capture K/V, token ids and surprisal of inputs; see `seqkv_cli.kvcapture.api.capture`."""
    from seqkv_cli.kvcapture.api import capture as _capture

    return _capture(inputs, **options)


def load_capture(path):
    """Read a capture file written by `capture` / `seqkv capture`."""
    from seqkv_cli.kvcapture.capture_file import load_capture as _load

    return _load(path)


def to_dynamic_cache(capture_obj, dtype=None):
    """A capture as a `transformers` DynamicCache (batch 1), ready to continue generation."""
    from seqkv_cli.kvcapture.capture_file import to_dynamic_cache as _to_cache

    return _to_cache(capture_obj) if dtype is None else _to_cache(capture_obj, dtype)
