"""Codec registry: codec id -> class, filled by the built-ins and the ``seqkv.codecs`` entry points.

A third-party package registers codecs in its ``pyproject.toml``::

    [project.entry-points."seqkv.codecs"]
    mycodec = "mypackage.mymodule:MyCodec"

Entry points are read once, on the first lookup that misses or the first listing, so importing
seqkv_codecs stays cheap.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Iterable, Mapping
from importlib.metadata import entry_points
from typing import Any, TypeVar

from seqkv_codecs.base import Codec
from seqkv_codecs.errors import CodecError, UnknownCodecError

ENTRY_POINT_GROUP = "seqkv.codecs"
#: packages whose import registers the codecs shipped with seqkv_codecs
_BUILTIN_MODULES = ("seqkv_codecs.pervector",)

C = TypeVar("C", bound=type[Codec])

_registry: dict[str, type[Codec]] = {}
_builtins_loaded = False
_entry_points_loaded = False


def register_codec(cls: C) -> C:
    """Make ``cls`` findable under ``cls.codec_id``; usable as a class decorator.

    Registering the same class twice is harmless; a different class under a taken id is an error.
    """
    if not (isinstance(cls, type) and issubclass(cls, Codec)):
        raise CodecError(f"{cls!r} is not a Codec subclass")
    codec_id = getattr(cls, "codec_id", None)
    if not isinstance(codec_id, str) or not codec_id:
        raise CodecError(f"{cls.__name__} has no codec_id")
    known = _registry.get(codec_id)
    if known is not None and known is not cls:
        raise CodecError(
            f"codec id {codec_id!r} is already taken by {known.__module__}.{known.__qualname__}"
        )
    _registry[codec_id] = cls
    return cls


def _load_builtins() -> None:
    global _builtins_loaded
    if not _builtins_loaded:
        _builtins_loaded = True
        for name in _BUILTIN_MODULES:
            importlib.import_module(name)


def _load_entry_points() -> None:
    """Register third-party codecs; a plugin that fails to load is skipped with a warning."""
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in _registry:
            continue
        try:
            register_codec(ep.load())
        except Exception as exc:  # a broken plugin must not take the built-ins down with it
            warnings.warn(
                f"codec entry point {ep.name!r} ({ep.value}) failed to load: {exc}", stacklevel=3
            )


def available_codecs() -> list[type[Codec]]:
    """Every registered codec class, sorted by id."""
    _load_builtins()
    _load_entry_points()
    return [_registry[k] for k in sorted(_registry)]


def get_codec(config_or_id: str | Mapping[str, Any]) -> Codec:
    """Instantiate a codec from its id (default parameters) or from a config dict."""
    if isinstance(config_or_id, str):
        config: dict[str, Any] = {"id": config_or_id}
    elif isinstance(config_or_id, Mapping):
        config = dict(config_or_id)
    else:
        raise CodecError(f"a codec is named by an id or a config dict, not {config_or_id!r}")
    codec_id = config.get("id")
    if not isinstance(codec_id, str):
        raise CodecError(f"codec config {config!r} has no string 'id'")
    _load_builtins()
    if codec_id not in _registry:
        _load_entry_points()
    cls = _registry.get(codec_id)
    if cls is None:
        raise UnknownCodecError(
            f"unknown codec id {codec_id!r}; available: {', '.join(sorted(_registry))}"
        )
    return cls.from_config(config)


def pipeline_from_configs(configs: Iterable[str | Mapping[str, Any]]) -> list[Codec]:
    """Instantiate an ordered pipeline (the list stored in a container header)."""
    return [get_codec(c) for c in configs]
