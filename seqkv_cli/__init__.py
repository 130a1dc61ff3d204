"""seqkv: capture, compress, restore and report transformer KV caches.

The public functions (docs/API.md) are the library's own, with their own signatures: each is
imported from the package that holds it on first use, so that `import seqkv_cli` and
`seqkv --help` load no torch or transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from seqkv_cli.errors import SeqkvError
from seqkv_cli.version import __version__

if TYPE_CHECKING:  # what type checkers and editors see; at run time `__getattr__` loads them
    from seqkv_cli.api import compress_sessions, open_archive
    from seqkv_cli.archive import compress_captures as compress
    from seqkv_cli.kvcapture.api import capture
    from seqkv_cli.kvcapture.caches import to_dynamic_cache
    from seqkv_cli.kvcapture.capture_file import load_capture
    from seqkv_cli.report.collect import report as build_report
    from seqkv_cli.runtime.embedded import embedded_model_path as embedded_model_folder
    from seqkv_cli.scale.local import compress_dataset

# public name -> (module, name there)
_PUBLIC = {
    "open_archive": ("seqkv_cli.api", "open_archive"),
    "compress": ("seqkv_cli.archive", "compress_captures"),
    "compress_sessions": ("seqkv_cli.api", "compress_sessions"),
    "compress_dataset": ("seqkv_cli.scale.local", "compress_dataset"),
    "capture": ("seqkv_cli.kvcapture.api", "capture"),
    "load_capture": ("seqkv_cli.kvcapture.capture_file", "load_capture"),
    "to_dynamic_cache": ("seqkv_cli.kvcapture.caches", "to_dynamic_cache"),
    "build_report": ("seqkv_cli.report.collect", "report"),
    "embedded_model_folder": ("seqkv_cli.runtime.embedded", "embedded_model_path"),
}

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


def __getattr__(name: str) -> object:
    try:
        module, attribute = _PUBLIC[name]
    except KeyError:
        raise AttributeError(f"module 'seqkv_cli' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value  # imported once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})
