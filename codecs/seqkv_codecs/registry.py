"""Codec registries: codec id -> class, filled by built-ins and an entry-point group.

`Registry` is the one implementation; it serves the per-vector codecs here (`CODECS`, group
``seqkv.codecs``) and seqkv's session codecs (seqkv_cli/sequential/registry.py, group
``seqkv.session_codecs``). A third-party package registers codecs in its ``pyproject.toml``::

    [project.entry-points."seqkv.codecs"]
    mycodec = "mypackage.mymodule:MyCodec"

Built-ins come either from modules whose import registers them or as ``"module:Class"``
targets imported on first use. Entry points are read once, on the first lookup that misses
or the first listing, so importing a registry stays cheap; a plug-in that fails to load is
skipped with a warning, so it cannot take the built-ins down with it.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Mapping
from importlib.metadata import entry_points
from typing import Any, Generic, TypeVar

from seqkv_codecs.base import Codec
from seqkv_codecs.errors import CodecError, UnknownCodecError

T = TypeVar("T", bound=type)


def load_target(target: str) -> Any:
    """The object a ``"module:name"`` target names."""
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


class Registry(Generic[T]):
    """Classes of one kind, found by their ``codec_id``.

    ``base``: the class every entry subclasses, or its ``"module:Class"`` target (imported when
    the first class registers). ``error``: what a refused registration raises. ``kind``: how
    messages name an entry ("codec", "session codec"). ``builtins``: id -> ``"module:Class"``,
    listed first, in order. ``builtin_modules``: modules whose import registers classes.
    """

    def __init__(
        self,
        group: str,
        base: type | str,
        error: type[Exception],
        kind: str,
        builtins: Mapping[str, str] | None = None,
        builtin_modules: tuple[str, ...] = (),
    ) -> None:
        self.group, self.kind, self.error = group, kind, error
        self._base = base
        self.builtins = dict(builtins or {})
        self._builtin_modules = builtin_modules
        self._classes: dict[str, T] = {}
        self._modules_loaded = False
        self._entry_points_loaded = False

    def register(self, cls: T) -> T:
        """Make ``cls`` findable under ``cls.codec_id``; usable as a class decorator.

        Registering the same class twice is harmless; a different class under a taken id is
        an error.
        """
        base = load_target(self._base) if isinstance(self._base, str) else self._base
        if not (isinstance(cls, type) and issubclass(cls, base)):
            raise self.error(f"{cls!r} is not a {base.__name__} subclass")
        codec_id = getattr(cls, "codec_id", None)
        if not isinstance(codec_id, str) or not codec_id:
            raise self.error(f"{cls.__name__} has no codec_id")
        known = self._classes.get(codec_id)
        if known is not None and known is not cls:
            raise self.error(
                f"{self.kind} id {codec_id!r} is already taken by "
                f"{known.__module__}.{known.__qualname__}"
            )
        self._classes[codec_id] = cls
        return cls

    def _load_modules(self) -> None:
        if not self._modules_loaded:
            self._modules_loaded = True
            for name in self._builtin_modules:
                importlib.import_module(name)

    def _load_builtin(self, codec_id: str) -> T:
        target = self.builtins[codec_id]
        cls = load_target(target)
        if getattr(cls, "codec_id", None) != codec_id:
            raise self.error(f"{target} does not declare id {codec_id}")
        return self.register(cls)

    def _load_entry_points(self) -> None:
        """Register third-party classes; one that fails to load is skipped with a warning."""
        if self._entry_points_loaded:
            return
        self._entry_points_loaded = True
        for ep in entry_points(group=self.group):
            if ep.name in self._classes or ep.name in self.builtins:
                continue
            try:
                self.register(ep.load())
            except Exception as exc:  # a broken plugin must not take the built-ins down with it
                warnings.warn(
                    f"{self.kind} entry point {ep.name!r} ({ep.value}) failed to load: {exc}",
                    stacklevel=4,
                )

    def lookup(self, codec_id: str) -> T | None:
        """The class registered under ``codec_id``, or None."""
        if codec_id in self._classes:
            return self._classes[codec_id]
        if codec_id in self.builtins:
            return self._load_builtin(codec_id)
        self._load_modules()
        if codec_id not in self._classes:
            self._load_entry_points()
        return self._classes.get(codec_id)

    def ids(self) -> list[str]:
        """Every id, sorted, without importing the built-in targets."""
        self._load_modules()
        self._load_entry_points()
        return sorted({*self.builtins, *self._classes})

    def classes(self) -> list[T]:
        """Every class: the built-in targets first, in order, then the others by id."""
        self._load_modules()
        self._load_entry_points()
        first = [self.lookup(i) for i in self.builtins]
        rest = [self._classes[i] for i in sorted(self._classes) if i not in self.builtins]
        return [*first, *rest]


#: the per-vector codecs of this library (built-ins: importing seqkv_codecs.pervector)
CODECS: Registry[type[Codec]] = Registry(
    "seqkv.codecs",
    Codec,
    CodecError,
    "codec",
    builtin_modules=("seqkv_codecs.pervector",),
)
ENTRY_POINT_GROUP = CODECS.group
register_codec = CODECS.register


def available_codecs() -> list[type[Codec]]:
    """Every registered codec class, sorted by id."""
    return CODECS.classes()


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
    cls = CODECS.lookup(codec_id)
    if cls is None:
        raise UnknownCodecError(
            f"unknown codec id {codec_id!r}; available: {', '.join(CODECS.ids())}"
        )
    return cls.from_config(config)
