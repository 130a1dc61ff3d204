"""The canonical forward as the codec library's `LogitsModel`, plus what restore needs."""

from __future__ import annotations

import numpy as np
import torch

from seqkv_cli.kvcapture.engine import surprisal_bits


class CanonicalLogits:
    """Feeds a `CanonicalLM`; keeps the K/V state and the surprisal of every fed token.

    The token coder never feeds a session's last token (no position follows it), but its K/V
    belongs to the cache, so `finish` feeds it. Surprisal is computed with the same function
    as `capture` on bit-identical logits, so a restored capture carries identical values.
    """

    def __init__(self, canon) -> None:
        self.canon = canon
        self.vocab_size = canon.vocab_size
        self.state = None
        self._prev: torch.Tensor | None = None
        self._surprisal: list[torch.Tensor] = []
        self.fed = 0

    def start(self, capacity: int):
        self.state = self.canon.new_state(capacity + 1)
        self._prev, self._surprisal, self.fed = None, [], 0
        return self.state

    def feed(self, state, token_ids: np.ndarray) -> np.ndarray:
        ids = torch.from_numpy(np.asarray(token_ids, dtype=np.int64))
        logits = self.canon.forward(state, ids)
        rows = logits[:-1] if self._prev is None else torch.cat([self._prev[None], logits[:-1]])
        scored = ids[1:] if self._prev is None else ids
        if len(scored):
            self._surprisal.append(surprisal_bits(rows, scored))
        self._prev = logits[-1]
        self.fed += len(ids)
        return logits.numpy()

    def finish(self, tokens: np.ndarray) -> None:
        """Feed what the coder did not, so the state holds K/V for every token."""
        if self.state is None:
            self.start(len(tokens))
        rest = np.asarray(tokens[self.fed :], dtype=np.int64)
        if len(rest):
            self.feed(self.state, rest)

    @property
    def surprisal(self) -> torch.Tensor:
        if not self._surprisal:
            return torch.zeros(0, dtype=torch.float64)
        return torch.cat(self._surprisal)

    def kv(self, dtype: torch.dtype) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        layers = range(self.canon.num_layers)
        keys = [self.state.layer_kv(i)[0].to(dtype) for i in layers]
        values = [self.state.layer_kv(i)[1].to(dtype) for i in layers]
        return keys, values
