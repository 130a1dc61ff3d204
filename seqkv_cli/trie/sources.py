"""Sessions going into a trie: token ids up front, K/V only when their turn comes.

Planning a trie needs every session's tokens; checking a session's K/V needs its tensors,
one session at a time. Loading lazily keeps a 100-session compress at one capture in memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from seqkv_cli.container.layout import STORED_ELSEWHERE
from seqkv_cli.errors import SeqkvError
from seqkv_cli.trie.tables import NO_PPL

# Metadata that is each session's own even where sessions agree on it: a replay record says
# how one cache was computed (its digest differs, and format 1.9 stores it in binary per
# session; in a profile it would make every turn's profile a new one).
PER_SESSION = ("replay",)

if TYPE_CHECKING:
    import torch

    from seqkv_cli.kvcapture.capture_file import Capture
    from seqkv_cli.sequential.session_codec import SessionCodec
    from seqkv_codecs.base import Codec


@dataclass
class Source:
    session_id: str
    meta: dict
    tokens: np.ndarray  # int64
    path: Path | None = None
    capture: object | None = None  # an in-memory Capture instead of a file
    # The session codec that stores this session's residual, when it is not the archive's
    # (the library API's per-session tolerance); residual streams are self-describing.
    residual_coder: object | None = None
    # Tokens only: K/V and surprisal are by definition what the canonical recompute gives,
    # so the encoder takes them from its own walk instead of a second forward (no residual).
    recompute: bool = False

    @classmethod
    def from_path(cls, path: Path) -> Source:
        from seqkv_cli.kvcapture.capture_file import load_capture_tokens

        meta, tokens = load_capture_tokens(path)
        return cls(meta.get("session_id", "session"), meta, tokens.numpy().astype(np.int64), path)

    @classmethod
    def from_capture(cls, cap: Capture, residual_coder: SessionCodec | None = None) -> Source:
        tokens = cap.tokens.numpy().astype(np.int64)
        return cls(cap.session_id, cap.meta, tokens, None, cap, residual_coder)

    @classmethod
    def tokens_only(cls, session_id: str, tokens: Sequence[int] | np.ndarray, meta: dict) -> Source:
        """A session stored as its token ids; `meta` as a canonical capture's provenance."""
        arr = np.asarray(tokens, dtype=np.int64)
        return cls(session_id, {**meta, "session_id": session_id}, arr, recompute=True)

    def recomputed(
        self, keys: list[torch.Tensor], values: list[torch.Tensor], surprisal: torch.Tensor
    ):
        """A tokens-only session as the Capture its canonical recompute is."""
        import torch

        from seqkv_cli.kvcapture.capture_file import Capture

        return Capture(torch.from_numpy(self.tokens.copy()), keys, values, surprisal, self.meta)

    @property
    def where(self) -> str:
        """How messages name this session: its capture file, or its id when in memory."""
        return str(self.path) if self.path is not None else f"session {self.session_id}"

    def coder_for(self, coder: SessionCodec | Codec):
        """The codec that stores this session's residual (and checks its restore)."""
        return self.residual_coder or coder

    def load(self):
        if self.recompute:
            raise SeqkvError(f"{self.where} is stored as tokens only: it has no capture to load")
        if self.capture is not None:
            return self.capture
        from seqkv_cli.kvcapture.capture_file import load_capture

        cap = load_capture(self.path)
        if not np.array_equal(cap.tokens.numpy(), self.tokens):
            raise SeqkvError(f"{self.path} changed while it was being compressed")
        return cap


def profile_key(meta: dict) -> tuple:
    return (
        meta.get("dtype"),
        meta.get("numeric_path", "unknown"),
        int(meta.get("num_layers", 0)),
        int(meta.get("num_kv_heads", 0)),
        int(meta.get("head_dim", 0)),
    )


def _plain_meta(meta: dict) -> dict:
    # sorted: a capture file's metadata order varies between runs; the index must not
    return {
        k: meta[k]
        for k in sorted(meta)
        if isinstance(meta[k], str | int | float | dict) and k not in STORED_ELSEWHERE
    }


def profiles_for(sources: list[Source]) -> tuple[list[dict], list[int], list[dict]]:
    """Profiles (what sessions share), each session's profile index and its own extras.

    Metadata equal across a profile's sessions is stored once; what differs (the source
    path, the capture time) stays per session, and is compressed with the session names.
    """
    keys: list[tuple] = []
    index_of = []
    for src in sources:
        key = profile_key(src.meta)
        if key not in keys:
            keys.append(key)
        index_of.append(keys.index(key))
    profiles, extras = [], [dict() for _ in sources]
    for p, key in enumerate(keys):
        members = [i for i, k in enumerate(index_of) if k == p]
        metas = [_plain_meta(sources[i].meta) for i in members]
        common = {
            k: v
            for k, v in metas[0].items()
            if k not in PER_SESSION and all(m.get(k) == v for m in metas[1:])
        }
        for i, m in zip(members, metas, strict=True):
            extras[i] = {k: v for k, v in m.items() if k not in common}
        dtype, numeric_path, layers, heads, head_dim = key
        profiles.append(
            {
                "dtype": dtype,
                "numeric_path": numeric_path,
                "shapes": {"num_layers": layers, "num_kv_heads": heads, "head_dim": head_dim},
                "capture_meta": common,
            }
        )
    return profiles, index_of, extras


def ppl_milli(surprisal: torch.Tensor | np.ndarray) -> int:
    """log2 PP in thousandths of a bit, as the session table stores it."""
    if surprisal.numel() == 0:
        return NO_PPL
    return min(round(float(surprisal.mean()) * 1000), NO_PPL - 1)
