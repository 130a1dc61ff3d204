"""Reading sessions back out of a container: decode sections into captures.

`Archive` opens the file, checks its header and model, and hands each restore to the path
for its shape: archive/restore_trie.py (trie archives) or archive/restore_flat.py (one set of
sections per session).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from seqkv_cli.archive.entries import check_entry
from seqkv_cli.container import open_container
from seqkv_cli.container.layout import capture_meta_of, kv_part, section_name
from seqkv_cli.errors import SeqkvError
from seqkv_cli.kvcapture.blocks import to_tensor
from seqkv_cli.kvcapture.capture_file import check_capture
from seqkv_cli.sequential.load_modes import segment_codec
from seqkv_cli.sequential.registry import capabilities, resolve_codec
from seqkv_cli.trie import (
    MAX_POSITIONS,
    NodeSource,
    PartReader,
    chain,
    check_context,
    check_precision,
    load_trie,
    node_steps,
    session_entries,
)
from seqkv_codecs.errors import CodecError

if TYPE_CHECKING:
    from seqkv_cli.kvcapture.capture_file import Capture
    from seqkv_cli.runtime.loading import LoadedModel

SESSION_BATCH = 16  # model-backed sessions decoded in lockstep (memory: one K/V state each)


class Archive:
    """An open container plus its decoding pipeline; sessions decode one at a time."""

    def __init__(self, path: Path | str, model: str | LoadedModel | None = None) -> None:

        self.path = Path(path)
        # Told (tokens decoded so far, tokens to decode) while model codecs restore: progress.
        self.on_tokens: Callable[[int, int], None] | None = None
        self.decode_stats = None  # trie.decode.DecodeStats of the latest trie restore
        if not self.path.is_file():
            raise SeqkvError(f"no such file: {self.path}")
        self.reader = open_container(self.path)
        header = self.reader.header
        self.trie = None
        self.sessions: list[dict] = header["sessions"]
        if "trie" in header:
            # The model (and its context) is known only once loaded: canonical() checks again.
            self.trie = load_trie(self.reader, self.path, max_context=MAX_POSITIONS)
            sizes = {s.name: s.length for s in self.reader.sections}
            self.sessions = session_entries(self.trie, sizes, self.reader.read_section)
        for entry in self.sessions:
            check_entry(self.path, entry)
        self.model: dict = header["model"] or {}
        pipeline = header["pipeline"]
        if len(pipeline) != 1:
            raise SeqkvError(f"{self.path}: pipelines of {len(pipeline)} stages are not supported")
        self.codec = resolve_codec(pipeline[0])
        if self.needs_model:  # from the file's own config: refuse a bad one in one line
            try:
                check_precision(getattr(self.codec, "precision_bits", 24))
            except SeqkvError as exc:
                raise SeqkvError(f"{self.path}: {exc}") from None
        self._model_spec, self._canon = model, None
        if self.trie is not None:
            self.read_part = PartReader(self.reader, self.trie.embedded)
            for k, codec_id in self.trie.codecs.items():  # named by a segment: one line if bad
                try:
                    segment_codec(self.codec, codec_id, k)
                except SeqkvError as exc:
                    raise SeqkvError(f"{self.path}: {exc}") from None

    def load_mode(self, entry: dict) -> str:
        """How the session's tokens load (sequential/load_modes.py): "small" (decoded by
        stepping the model), "fast" (read, then one prefill) or "mixed" (a fast session on a
        small prefix, or the other way round); per-vector archives load "fast"."""
        if self.trie is None or not self.needs_model:
            return "small" if capabilities(self.codec).steps_model else "fast"
        steps = node_steps(self.trie, self.codec)
        path = chain(self.trie.nodes, self.trie.sessions[entry["index"]].end_node)
        kinds = {steps[n] for n in path}
        return "mixed" if len(kinds) > 1 else ("small" if kinds == {True} else "fast")

    def known_tokens(self, entry: dict, vocab_size: int) -> np.ndarray | None:
        """The session's token ids where they are read without the model (every node on its
        path is coded `seq-fast`, and it is not a near-duplicate's edit), else None."""
        if self.trie is None or not self.needs_model or entry["trie"].get("centroid") is not None:
            return None
        rec = self.trie.sessions[entry["index"]]
        path = chain(self.trie.nodes, rec.end_node)
        steps = node_steps(self.trie, self.codec)
        if any(steps[n] for n in path):
            return None
        source = NodeSource(self.trie, self.read_part, vocab_size, self.codec.precision_bits)
        # each node up to where the next one branches off it; the last up to the session's end
        ends = [self.trie.nodes[n].attach for n in path[1:]] + [rec.end]
        return np.concatenate([source.tokens(n)[:end] for n, end in zip(path, ends, strict=True)])

    @property
    def needs_model(self) -> bool:
        return capabilities(self.codec).needs_canonical

    def canonical(self):
        """The model this container was compressed with, checked by fingerprint."""
        if self._canon is None:
            from seqkv_cli.archive.identity import fingerprint_matches, load_canonical

            canon, ident = load_canonical(self._model_spec, self.codec.numerics)
            want = self.model.get("fingerprint", "?")
            if not fingerprint_matches(want, ident["fingerprint"]):
                name = self.model.get("name")  # compact files record the fingerprint only
                was = f"model {name}" if name else "another model"
                raise SeqkvError(
                    f"{self.path} was compressed with {was} (fingerprint {want[:16]}); the "
                    f"loaded model {ident['name']} differs (fingerprint "
                    f"{ident['fingerprint'][:16]}); pass --model with the right one"
                )
            if want != ident["fingerprint"]:  # a compact file's prefix: restored captures
                self.model = dict(ident)  # name the model whole, as their capture did
            if self.trie is not None:
                check_context(self.trie, canon.max_context, self.path)
            self._canon = canon
        return self._canon

    def __enter__(self) -> Archive:
        return self

    def __exit__(self, *exc) -> None:
        self.reader.close()

    def session(self, session_id: str) -> dict:
        for entry in self.sessions:
            if entry["id"] == session_id:
                return entry
        known = ", ".join(e["id"] for e in self.sessions[:10])
        raise SeqkvError(f"{self.path} has no session '{session_id}' (it has: {known})")

    def decode_kv(self, entry: dict, layer: int, kind: str) -> torch.Tensor:

        name = section_name(entry["index"], kv_part(layer, kind))
        data = self.reader.read_section(name)  # checks the section's CRC32C
        expected = (
            entry["shapes"]["num_kv_heads"],
            entry["positions"],
            entry["shapes"]["head_dim"],
        )
        try:  # the stream's own header is checked against the entry before anything is decoded
            block = self.codec.decode_checked(data, expected, entry["dtype"], kind)
        except CodecError as exc:
            raise SeqkvError(f"{self.path}: section {name} does not decode: {exc}") from None
        return to_tensor(block)

    def restore(self, entry: dict):
        """The session as a Capture (K/V decoded by the pipeline)."""
        [(_, result)] = self.restore_many([entry])
        if isinstance(result, Exception):
            raise result
        return result

    def restore_many(self, entries: list[dict], batch: int = SESSION_BATCH):
        """Yield (entry, Capture or the SeqkvError that stopped it): a flat archive's in
        order, a trie archive's as they finish.

        Model-backed sessions are decoded `batch` at a time in lockstep (one model pass per
        position for all of them); a damaged session does not stop the others.
        """
        if self.trie is not None:
            from seqkv_cli.archive.restore_trie import restore_trie

            yield from restore_trie(self, entries)
        else:
            from seqkv_cli.archive.restore_flat import restore_flat

            yield from restore_flat(self, entries, batch)

    def with_meta(self, entry: dict, restored: Capture | Exception):
        """`restored` (a Capture, or the error that stopped it) with the entry's metadata, or
        the one-line error when that metadata contradicts the decoded tensors (a shape field
        changed and re-signed)."""
        if not isinstance(restored, Exception):
            restored.meta = capture_meta_of(entry, self.model)
            try:
                check_capture(restored, f"{self.path}: session {entry['id']}")
            except SeqkvError as exc:
                return exc
        return restored
