"""Which codecs exist and what each can do: the one place a codec id is looked up.

Session codecs (sequential/session_codec.py) are found like the codec library's per-vector
codecs (seqkv_codecs/registry.py): the built-ins below, plus third-party classes named in the
``seqkv.session_codecs`` entry-point group::

    [project.entry-points."seqkv.session_codecs"]
    mycodec = "mypackage.mymodule:MySessionCodec"

Built-ins are named as ``module:Class`` and imported on first use, so listing ids stays cheap
and a codec's module is the only place that knows how it codes. Everything else asks
`capabilities` instead of comparing ids.
"""

from __future__ import annotations

import importlib
import warnings
from dataclasses import dataclass
from importlib.metadata import entry_points

from seqkv_cli.errors import SeqkvError

ENTRY_POINT_GROUP = "seqkv.session_codecs"

#: id -> "module:Class" of the session codecs shipped with seqkv
BUILTIN_SESSION_CODECS = {
    "seq": "seqkv_cli.sequential.seq:SeqCodec",
    "seq-fast": "seqkv_cli.sequential.seq_fast:SeqFastCodec",
    "delta-topk": "seqkv_cli.sequential.delta_topk:DeltaTopKCodec",
}

_classes: dict[str, type] = {}
_entry_points_loaded = False


@dataclass(frozen=True)
class Capabilities:
    """What a codec can do, as the container, trie, restore and report layers need to know."""

    needs_canonical: bool  # restore runs the model's canonical forward
    steps_model: bool  # tokens coded under the model: decode steps it per token
    trie_capable: bool  # sessions can share prefixes in a trie archive
    takes_residual: bool  # accepts residual= / tolerance=
    lossless: bool  # restore is bit-exact


def register_session_codec(cls: type) -> type:
    """Make a SessionCodec subclass findable under its ``codec_id``; usable as a decorator."""
    from seqkv_cli.sequential.session_codec import SessionCodec

    if not (isinstance(cls, type) and issubclass(cls, SessionCodec)):
        raise SeqkvError(f"{cls!r} is not a SessionCodec subclass")
    codec_id = getattr(cls, "codec_id", None)
    if not isinstance(codec_id, str) or not codec_id:
        raise SeqkvError(f"{cls.__name__} has no codec_id")
    known = _classes.get(codec_id)
    if known is not None and known is not cls:
        raise SeqkvError(f"session codec id {codec_id!r} is already taken by {known.__qualname__}")
    _classes[codec_id] = cls
    return cls


def _load(target: str) -> type:
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def _load_entry_points() -> None:
    """Third-party session codecs; one that fails to load is skipped with a warning."""
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in _classes or ep.name in BUILTIN_SESSION_CODECS:
            continue
        try:
            register_session_codec(ep.load())
        except Exception as exc:  # a broken plugin must not take the built-ins down with it
            warnings.warn(
                f"session codec entry point {ep.name!r} ({ep.value}) failed to load: {exc}",
                stacklevel=3,
            )


def session_codec_class(codec_id: str) -> type | None:
    """The SessionCodec class registered under `codec_id`, or None for any other id."""
    if codec_id in _classes:
        return _classes[codec_id]
    if codec_id in BUILTIN_SESSION_CODECS:
        cls = _load(BUILTIN_SESSION_CODECS[codec_id])
        if getattr(cls, "codec_id", None) != codec_id:
            raise SeqkvError(f"{BUILTIN_SESSION_CODECS[codec_id]} does not declare id {codec_id}")
        return register_session_codec(cls)
    _load_entry_points()
    return _classes.get(codec_id)


def session_codec_classes() -> list[type]:
    """Every session codec class, built-ins first, then plugins by id."""
    _load_entry_points()
    builtins = [session_codec_class(i) for i in BUILTIN_SESSION_CODECS]
    plugins = [_classes[i] for i in sorted(_classes) if i not in BUILTIN_SESSION_CODECS]
    return [*builtins, *plugins]


def codec_ids() -> list[str]:
    """Every codec id compress accepts (session and per-vector), sorted."""
    from seqkv_codecs.registry import available_codecs

    _load_entry_points()
    session = {*BUILTIN_SESSION_CODECS, *_classes}
    return sorted([*session, *(c.codec_id for c in available_codecs())])


def resolve_codec(spec: str | dict):
    """A codec instance from an id or a config; an unknown id lists the valid ones."""
    from seqkv_codecs.errors import CodecError, UnknownCodecError
    from seqkv_codecs.registry import get_codec

    codec_id = spec if isinstance(spec, str) else spec.get("id")
    cls = session_codec_class(codec_id) if isinstance(codec_id, str) else None
    if cls is not None:
        return cls() if isinstance(spec, str) else cls.from_config(spec)
    try:
        return get_codec(spec)
    except (CodecError, ValueError) as exc:
        if not isinstance(exc, UnknownCodecError):
            raise SeqkvError(f"bad codec config {spec}: {exc}") from None
        raise SeqkvError(
            f"unknown codec id {codec_id!r}; available: {', '.join(codec_ids())}"
        ) from None


def capabilities(coder) -> Capabilities:
    """What `coder` (an instance or class: session or per-vector) can do."""
    if getattr(coder, "needs_canonical", False):  # a SessionCodec
        return Capabilities(
            needs_canonical=True,
            steps_model=coder.steps_model,
            trie_capable=coder.trie_capable,
            takes_residual=coder.takes_residual,
            lossless=bool(coder.lossless),
        )
    # per-vector codecs of the codec library: K/V coded block by block, tokens stored plain
    return Capabilities(
        needs_canonical=False,
        steps_model=False,
        trie_capable=True,
        takes_residual=False,
        lossless=bool(getattr(coder, "lossless", False)),
    )


def codec_capabilities(codec_id: str) -> Capabilities | None:
    """Capabilities of the codec class registered under `codec_id` (None if unknown)."""
    cls = session_codec_class(codec_id)
    if cls is not None:
        return capabilities(cls)
    from seqkv_codecs.errors import CodecError
    from seqkv_codecs.registry import available_codecs

    try:
        found = [c for c in available_codecs() if c.codec_id == codec_id]
    except CodecError:
        return None
    return capabilities(found[0]) if found else None
