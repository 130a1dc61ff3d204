"""Which codecs exist and what each can do: the one place a codec id is looked up.

Session codecs (sequential/session_codec.py) are found by the codec library's one `Registry`
(seqkv_codecs/registry.py), as its per-vector codecs are: the built-ins below, plus
third-party classes named in the ``seqkv.session_codecs`` entry-point group::

    [project.entry-points."seqkv.session_codecs"]
    mycodec = "mypackage.mymodule:MySessionCodec"

Built-ins are named as ``module:Class`` and imported on first use, so listing ids stays cheap
and a codec's module is the only place that knows how it codes. Everything else asks
`capabilities` instead of comparing ids.
"""

from __future__ import annotations

from dataclasses import dataclass

from seqkv_cli.errors import SeqkvError
from seqkv_codecs.registry import Registry

#: id -> "module:Class" of the session codecs shipped with seqkv
BUILTIN_SESSION_CODECS = {
    "seq": "seqkv_cli.sequential.seq:SeqCodec",
    "seq-fast": "seqkv_cli.sequential.seq_fast:SeqFastCodec",
    "delta-topk": "seqkv_cli.sequential.delta_topk:DeltaTopKCodec",
}

#: the session codecs; SessionCodec is named, not imported, so listing ids stays cheap
SESSION_CODECS: Registry[type] = Registry(
    "seqkv.session_codecs",
    "seqkv_cli.sequential.session_codec:SessionCodec",
    SeqkvError,
    "session codec",
    builtins=BUILTIN_SESSION_CODECS,
)
ENTRY_POINT_GROUP = SESSION_CODECS.group
register_session_codec = SESSION_CODECS.register
session_codec_class = SESSION_CODECS.lookup  # the class under an id, or None for any other
session_codec_classes = SESSION_CODECS.classes  # built-ins first, then plugins by id


@dataclass(frozen=True)
class Capabilities:
    """What a codec can do, as the container, trie, restore and report layers need to know."""

    needs_canonical: bool  # restore runs the model's canonical forward
    steps_model: bool  # tokens coded under the model: decode steps it per token
    trie_capable: bool  # sessions can share prefixes in a trie archive
    takes_residual: bool  # accepts residual= / tolerance=
    lossless: bool  # restore is bit-exact


def codec_ids() -> list[str]:
    """Every codec id compress accepts (session and per-vector), sorted."""
    from seqkv_codecs.registry import CODECS

    return sorted([*SESSION_CODECS.ids(), *CODECS.ids()])


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
