"""The canonical forward as the codec library's `LogitsModel`, plus what restore needs."""

from __future__ import annotations

import numpy as np
import torch


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
    def surprisal(self) -> torch.Tensor:
        if not self._surprisal:
            return torch.zeros(0, dtype=torch.float64)
        return torch.cat(self._surprisal)

    def kv(self, num_layers: int, dtype: torch.dtype):
        keys = [self.state.layer_kv(i)[0].to(dtype) for i in range(num_layers)]
        values = [self.state.layer_kv(i)[1].to(dtype) for i in range(num_layers)]
        return keys, values


class CanonicalLogits:
    """Feeds a `CanonicalLM` for the token coder, one sequence or several in lockstep.

    The coder never feeds a session's last token (no position follows it), but its K/V
    belongs to the cache: states get one position of headroom and `finish` feeds the rest.
    """

    def __init__(self, canon) -> None:
        self.canon = canon
        self.vocab_size = canon.vocab_size
        self.tracks: list[Track] = []

    def start(self, capacity: int) -> Track:
        track = Track(self.canon.new_state(capacity + 1), self.canon.surprisal)
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

    def finish(self, track: Track | None, tokens: np.ndarray) -> Track:
        """Feed what the coder did not, so the state holds K/V for every token."""
        if track is None:
            track = self.start(len(tokens))
        rest = np.asarray(tokens[track.fed :], dtype=np.int64)
        if len(rest):
            self.feed(track, rest)
        return track
