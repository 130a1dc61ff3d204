"""The canonical forward as the codec library's `LogitsModel`, plus what restore needs."""

from __future__ import annotations

import os

import numpy as np
import torch

from seqkv_cli.runtime.forward import CanonicalForward

# Positions a state keeps beyond its tokens, so a pass can carry guessed tokens to its end
# (draft-and-verify decoding: seqkv_codecs.sequential.drafts).
DRAFT_HEADROOM = 8


def drafts_enabled() -> bool:
    """Draft-and-verify is on unless SEQKV_DRAFTS=off (a diagnostic: same bits either way)."""
    return os.environ.get("SEQKV_DRAFTS", "on").strip().lower() not in ("off", "0", "no")


class Track:
    """One sequence being fed: its K/V state and the surprisal of every token fed so far.

    Surprisal is computed with the canonical path's function, as `capture` does, on
    bit-identical logits, so a restored capture carries identical values.
    """

    def __init__(self, state, surprisal_fn, fed: int = 0, surprisal=None, prev_row=None) -> None:
        """A track over `state`; a fork passes what its state already holds: `fed`
        positions, the `surprisal` of tokens 1..fed-1 and the logits after the last one."""
        self.state = state
        self._surprisal_fn = surprisal_fn  # the canonical path's own (bit-identical) function
        self.fed = fed
        self._prev: torch.Tensor | None = prev_row
        self._surprisal: list[torch.Tensor] = (
            [surprisal] if surprisal is not None and len(surprisal) else []
        )

    def record(self, ids: torch.Tensor, logits: torch.Tensor) -> None:
        if self._prev is None:
            rows, scored = logits[:-1], ids[1:]
        else:
            rows, scored = torch.cat([self._prev[None], logits[:-1]]), ids
        if len(scored):
            self._surprisal.append(self._surprisal_fn(rows, scored))
        self._prev = logits[-1]
        self.fed += len(ids)

    @property
    def last_row(self) -> torch.Tensor | None:
        """The logits after the last position fed (what predicts the next token)."""
        return self._prev

    @property
    def surprisal(self) -> torch.Tensor:
        if not self._surprisal:
            return torch.zeros(0, dtype=torch.float64)
        return torch.cat(self._surprisal)

    def kv(self, num_layers: int, dtype: torch.dtype):
        keys = [self.state.layer_kv(i)[0].to(dtype) for i in range(num_layers)]
        values = [self.state.layer_kv(i)[1].to(dtype) for i in range(num_layers)]
        return keys, values

    def unrounded(self, kind: str, layer: int) -> torch.Tensor:
        """One layer's K (`kind` "key") or V before rounding to a capture's dtype."""
        return unrounded_kv(self.state)(kind, layer)


def unrounded_kv(state, n: int | None = None):
    """`(kind, layer) -> float32 tensor`: K or V of `state`'s first `n` positions before their
    rounding to a capture's dtype. Read only where a residual needs it (`SKR2` models the
    residual on the rounding), so sessions without residuals copy nothing."""

    def read(kind: str, layer: int) -> torch.Tensor:
        return state.layer_kv(layer, n)[1 if kind == "value" else 0].float()

    return read


class CanonicalLogits:
    """Feeds a `CanonicalForward` for the token coder, one sequence or several in lockstep.

    The coder never feeds a session's last token (no position follows it), but its K/V
    belongs to the cache: states get one position of headroom and `finish` feeds the rest.
    """

    def __init__(self, canon: CanonicalForward) -> None:
        self.canon = canon
        self.vocab_size = canon.vocab_size
        self.tracks: list[Track] = []

    def room(self, capacity: int) -> int:
        """Positions to allocate for `capacity`: one more (the coder never feeds a session's
        last token; `finish` does) and draft headroom, within the model context (a capacity
        past the context is left for new_state to refuse)."""
        limit = self.canon.max_context
        return capacity if capacity > limit else min(capacity + 1 + DRAFT_HEADROOM, limit)

    def start(self, capacity: int) -> Track:
        track = Track(self.canon.new_state(self.room(capacity)), self.canon.surprisal)
        self.tracks.append(track)
        return track

    def feed(self, track: Track, token_ids: np.ndarray) -> np.ndarray:
        ids = torch.from_numpy(np.asarray(token_ids, dtype=np.int64))
        logits = self.canon.forward(track.state, ids)
        track.record(ids, logits)
        return logits.numpy()

    def feed_rows(self, tracks: list[Track], token_ids: np.ndarray) -> np.ndarray:
        ids = torch.from_numpy(np.asarray(token_ids, dtype=np.int64))
        logits = self.canon.forward_rows([t.state for t in tracks], ids.tolist())
        for row, track in enumerate(tracks):
            track.record(ids[row : row + 1], logits[row : row + 1])
        return logits.numpy()

    def feed_drafts(self, tracks: list[Track], token_lists: list) -> list[np.ndarray]:
        """Feed each track its tokens (the last decoded one, then guesses) in one pass; the
        logits (m, V) of every token fed. Rows of a pass are padded to the longest, so where
        a state has no room for that (a session near the model context) every list is cut
        to what fits: the caller reads how many were fed from the logits. Nothing is
        recorded until `accept` says what was right."""
        room = min(t.state.capacity - t.state.length for t in tracks)
        lists = [[int(x) for x in ids[: max(1, room)]] for ids in token_lists]
        out = self.canon.forward_many([t.state for t in tracks], lists)
        return [logits.numpy() for logits in out]

    def accept(self, track: Track, token_ids, logits: np.ndarray, n: int) -> None:
        """Keep the first `n` of the tokens a `feed_drafts` call fed (`logits` has a row for
        each); the state forgets the rest (their K/V rows are overwritten by the next call)."""
        track.state.crop(n - len(logits))
        ids = torch.tensor([int(t) for t in token_ids[:n]], dtype=torch.long)
        track.record(ids, torch.from_numpy(logits[:n]))

    def finish(self, track: Track | None, tokens: np.ndarray) -> Track:
        """Feed what the coder did not, so the state holds K/V for every token."""
        if track is None:
            track = self.start(len(tokens))
        rest = np.asarray(tokens[track.fed :], dtype=np.int64)
        if len(rest):
            self.feed(track, rest)
        return track
