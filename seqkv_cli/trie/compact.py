"""`archive compact`: every session restored and written again as one optimal trie.

Appends leave one segment (and one index record) per `add`; compact folds them into one,
inserting shorter sessions first so a session that is a prefix of another ends where its own
node ends. It also converts flat (per-session) archives. The archive is locked meanwhile and
replaced atomically, only after the new file restores every session bit for bit.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from seqkv_cli.errors import SeqkvError


def compact(path: Path, model=None, on_wait=None, near_dup: bool = False):
    from seqkv_cli.container import locked_for_append
    from seqkv_cli.runtime.loading import LoadedModel, load_model
    from seqkv_cli.skv.compress import compress_captures, supports_trie
    from seqkv_cli.skv.restore import Archive, decompress

    path = Path(path)
    if not path.is_file():
        raise SeqkvError(f"no such archive: {path}")
    with locked_for_append(path, on_wait):
        with Archive(path) as arc:
            spec, ids, needs_model = (
                arc.codec.get_config(),
                [e["id"] for e in arc.sessions],
                (arc.needs_model),
            )
            if not supports_trie(arc.codec):
                raise SeqkvError(
                    f"codec {arc.codec.codec_id} keeps the flat layout; nothing to compact"
                )
        lm = None
        if needs_model:
            lm = model if isinstance(model, LoadedModel) else load_model(model)
        with tempfile.TemporaryDirectory(dir=path.parent, prefix=f".{path.name}.compact.") as tmp:
            files = decompress(path, Path(tmp), model=lm)
            by_id = {f.stem: f for f in files}
            ordered = [by_id[_stem(i)] for i in ids]
            return compress_captures(
                ordered, path, codec=spec, model=lm, check=True, near_dup=near_dup
            )


def _stem(session_id: str) -> str:
    from seqkv_cli.kvcapture.inputs import Document

    return Document(id=session_id, source="").file_stem
