"""Load modes: what a session costs to load, chosen per session where it is stored.

A model-backed trie archive codes each segment's new tokens one of two ways:

* ``"small"`` (`seq`): under the model's own next-token distribution, the fewest bytes; a
  load steps the model once a token to decode them.
* ``"fast"`` (`seq-fast`): under a static table of the segment's own token histogram, about
  the unigram entropy a token; a load reads the tokens and needs one prefill of the session,
  or no model pass at all where the cache comes back by replay (the user's own model runs it).

The archive's header names its codec; a segment coded by the other mode names its own in its
table (format 1.7, trie/tables.py), so `add(..., load="fast")` keeps one turn fast in a
`seq` archive. Both codecs share every other setting (precision, residual, numeric path),
which a segment therefore takes from the archive's codec.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from seqkv_cli.errors import SeqkvError
from seqkv_cli.sequential.registry import capabilities, codec_capabilities, resolve_codec

if TYPE_CHECKING:
    from seqkv_cli.sequential.session_codec import SessionCodec

#: load mode -> the session codec that stores a segment for it
MODE_CODECS = {"small": "seq", "fast": "seq-fast"}
LOAD_MODES = tuple(MODE_CODECS)
# what a segment takes from the archive's codec (the settings every session codec has)
_SHARED = ("precision_bits", "chunk_size", "residual", "tolerance", "numerics")


def check_mode(mode: object) -> str:
    if mode not in MODE_CODECS:
        raise SeqkvError(f"load must be one of {', '.join(map(repr, LOAD_MODES))}, not {mode!r}")
    return str(mode)


def load_mode(coder: SessionCodec) -> str:
    """The mode a codec stores for: "small" when a load steps the model per token."""
    return "small" if capabilities(coder).steps_model else "fast"


def mode_codec(base: SessionCodec, mode: str) -> SessionCodec:
    """The codec that stores a segment of `base`'s archive in load mode `mode`."""
    return segment_codec(base, MODE_CODECS[check_mode(mode)], 0)


def segment_codec(base, codec_id: str | None, segment: int):
    """The codec of a segment whose table names `codec_id` (None: the archive's `base`),
    with the archive's other settings; a name no model-backed trie codec answers to is
    refused in one line."""
    if codec_id is None or codec_id == getattr(base, "codec_id", None):
        return base
    caps = codec_capabilities(codec_id)
    if (
        caps is None
        or not (caps.needs_canonical and caps.trie_capable)
        or not capabilities(base).needs_canonical
    ):
        raise SeqkvError(
            f"trie segment {segment} names codec {codec_id!r}, which cannot code a segment of "
            f"this archive ({getattr(base, 'codec_id', '?')}): the file is damaged or newer"
        )
    config = {k: v for k, v in base.get_config().items() if k in _SHARED}
    return resolve_codec(dict(config, id=codec_id))
