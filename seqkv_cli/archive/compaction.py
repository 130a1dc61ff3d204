"""`archive compact`: every session restored and written again as one optimal trie.

Appends leave one segment (and one index record) per `add`; compact folds them into one. It
also converts flat (per-session) archives. The archive is locked meanwhile and replaced
atomically, only after the new file restores every session bit for bit. Through a symlink,
the file it names is compacted (the link stays a link). One trie is coded by one codec: every
session then loads the same way, the archive's own or the one `load` asks for (a session
added "fast" to a "small" archive is written small unless `load="fast"`).

Where the sessions keep nothing but tokens (an agent's turns), compact is after the smallest
file: longer sessions are inserted first, so a chain of turns is one node and one token
stream, and the result is a compact archive (format 1.8: a binary header and one deflated
table, no capture provenance) wherever the sessions fit one, unless `layout="trie"`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from seqkv_cli.archive.create import compress_captures, compress_sources
from seqkv_cli.archive.decompression import decompress
from seqkv_cli.archive.restore import Archive
from seqkv_cli.container import locked_for_append
from seqkv_cli.errors import SeqkvError
from seqkv_cli.fsutil import discard_quietly, staging_dir, write_target
from seqkv_cli.runtime.loading import LoadedModel, load_model
from seqkv_cli.sequential.load_modes import mode_codec
from seqkv_cli.sequential.registry import capabilities, resolve_codec
from seqkv_cli.trie import Source

# auto: a compact file where the sessions fit one, else the full trie layout
COMPACT_LAYOUTS = ("auto", "compact", "trie")

if TYPE_CHECKING:
    from seqkv_cli.sequential.session_codec import SessionCodec
    from seqkv_codecs.base import Codec


def compact(
    path: Path,
    model: str | LoadedModel | None = None,
    on_wait: Callable[[], None] | None = None,
    near_dup: bool = False,
    load: str | None = None,
    layout: str = "auto",
):

    path = write_target(path)
    if layout not in COMPACT_LAYOUTS:
        raise SeqkvError(f"unknown layout {layout!r}; use one of {', '.join(COMPACT_LAYOUTS)}")
    if not path.is_file():
        raise SeqkvError(f"no such archive: {path}")
    with locked_for_append(path, on_wait):
        with Archive(path) as arc:
            spec, ids, needs_model = (
                arc.codec.get_config(),
                [e["id"] for e in arc.sessions],
                (arc.needs_model),
            )
            if not capabilities(arc.codec).trie_capable:
                what = f"codec {arc.codec.codec_id}"
                if getattr(arc.codec, "parallel", 1) > 1:
                    what = f"seq --parallel {arc.codec.parallel} (runs coded per session)"
                raise SeqkvError(f"{what} keeps the flat layout; nothing to compact")
            refuse_lossy(path, arc.codec)
            if load is not None:
                if not needs_model:
                    raise SeqkvError(
                        f"{path} keeps K/V with the per-vector codec {arc.codec.codec_id}; "
                        "--load applies to seq and seq-fast archives"
                    )
                spec = mode_codec(arc.codec, load).get_config()
        lm = None
        if needs_model:
            lm = model if isinstance(model, LoadedModel) else load_model(model)
            sources = _tokens_decide(path, lm)
            if sources is not None:
                if len(sources) != len(ids):
                    raise SeqkvError(f"{path}: not every session restored; archive left as it was")
                coder = resolve_codec(spec)
                wanted = "smallest" if layout == "auto" else layout
                return compress_sources(
                    sources, path, coder, True, lm, None, near_dup, wanted, merge_prefixes=True
                )
        if layout == "compact":
            raise SeqkvError(f"{path} cannot be a compact file: its sessions keep more than tokens")
        # the full captures, in a staging folder of this run (a compact killed with SIGKILL
        # cannot remove it; the next writer in this folder does)
        try:
            scratch = staging_dir(path)
        except OSError as exc:
            raise SeqkvError(f"cannot write beside {path}: {exc.strerror or exc}") from None
        try:
            ordered = decompress(path, scratch, model=lm, numbered=True)
            if len(ordered) != len(ids):
                raise SeqkvError(f"{path}: not every session restored; archive left as it was")
            return compress_captures(
                ordered, path, codec=spec, model=lm, check=True, near_dup=near_dup
            )
        finally:
            discard_quietly(scratch)


def _tokens_decide(path: Path, lm: LoadedModel) -> list[Source] | None:
    """Every session as its tokens, where nothing but tokens decides them (a model-backed
    trie whose sessions keep no part of their own: no residual, no stored surprisal, no
    edits); None for any other archive. Such sessions are re-encoded from their tokens, with
    no capture file of their K/V written (an agent's 50 turns would write gigabytes)."""
    with Archive(path, model=lm) as arc:
        if arc.trie is None or any(e["sections"] for e in arc.sessions):
            return None
        by_index = {}  # restores finish in any order; the archive keeps its own
        for entry, restored in arc.restore_many(arc.sessions):
            if isinstance(restored, Exception):
                raise restored
            tokens = restored.tokens.numpy()
            by_index[entry["index"]] = Source.tokens_only(entry["id"], tokens, restored.meta)
        return [by_index[i] for i in sorted(by_index)]


def refuse_lossy(path: Path, codec: SessionCodec | Codec) -> None:
    """Compact decodes and encodes every session again: with a lossy codec each compact
    would add the codec's error once more (turbo3: 1.87 -> 2.19), and report success."""
    if not getattr(codec, "lossless", False):
        raise SeqkvError(
            f"{path} uses the lossy codec {codec.codec_id}; compact would quantize its "
            "sessions a second time: compress the original captures again instead"
        )
