"""Running the model along trie nodes: a branch starts from its parent's state, forked.

The canonical forward gives the same bits however a sequence is cut (docs/NUMERICS.md), so
the K/V and logits of a branch computed from a forked copy of its parent's state equal those
of a prefill of the whole session. Encoder and decoder both walk the trie this way: a shared
prefix is run once, each branch runs only its own tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from seqkv_cli.sequential.adapter import CanonicalLogits, Track

PREFILL_CHUNK = 256


def fork_track(
    adapter: CanonicalLogits, parent: Track, length: int, capacity: int, row: np.ndarray
) -> Track:
    """A new track holding the first `length` positions of `parent`, room for `capacity`.

    `row` is the parent's logits after position length - 1 (what predicts the branch's first
    token). The copy leaves the tail zero, exactly like a state that never saw those positions.
    """
    state = parent.state.fork(length, adapter.room(capacity))
    prefix = parent.surprisal[: max(length - 1, 0)].clone()
    track = Track(state, adapter.canon.surprisal, length, prefix, row)
    adapter.tracks.append(track)
    return track


@dataclass
class Run:
    """One node being run: where it starts, its tokens, the rows its children will need."""

    node: int
    start: int
    prefix: np.ndarray  # tokens before the node (positions 0..start-1)
    tokens: np.ndarray | None  # the node's tokens when known (encode, seq-fast)
    n_tokens: int
    track: Track
    first_row: torch.Tensor | None  # logits predicting the first token; None: uniform
    want_rows: set[int] = field(default_factory=set)  # offsets children attach at
    rows: dict[int, torch.Tensor] = field(default_factory=dict)

    def all_tokens(self, end: int) -> np.ndarray:
        return np.concatenate([self.prefix, self.tokens[:end]])

    def keep_row(self, offset: int, logits: torch.Tensor) -> None:
        """`logits` follow the node's token at `offset` - 1; keep them if a child starts there."""
        if offset in self.want_rows:
            self.rows[offset] = logits.clone()


def start_run(
    adapter: CanonicalLogits,
    parent: Run | None,
    node: int,
    start: int,
    attach: int,
    n_tokens: int,
    tokens: np.ndarray | None,
) -> Run:
    """A run for `node`: a fresh state for a root, else a fork of `parent` at its branch point."""
    capacity = start + n_tokens
    if parent is None:
        track, row, prefix = adapter.start(capacity), None, np.zeros(0, np.int64)
    else:
        row = parent.rows[attach]
        track = fork_track(adapter, parent.track, start, capacity, row)
        prefix = parent.all_tokens(attach)
    return Run(node, start, prefix, tokens, n_tokens, track, row)


def prefill(
    adapter: CanonicalLogits, run: Run, on_rows: Callable[[int, torch.Tensor], None] | None = None
) -> None:
    """Feed the run's known tokens in chunks; `on_rows(first, logits)` sees each chunk's rows.

    Row j of a chunk fed from offset `first` predicts the token at offset first + j + 1.
    """
    for s in range(0, run.n_tokens, PREFILL_CHUNK):
        chunk = run.tokens[s : min(s + PREFILL_CHUNK, run.n_tokens)]
        ids = torch.from_numpy(np.asarray(chunk, dtype=np.int64))
        logits = adapter.canon.forward(run.track.state, ids)
        run.track.record(ids, logits)
        for j in range(len(chunk)):
            if s + j + 1 in run.want_rows:
                run.keep_row(s + j + 1, logits[j])
        if on_rows is not None:
            on_rows(s, logits)


def session_kv(run: Run, end: int, dtype: torch.dtype, num_layers: int):
    """K/V (per layer, (kv_heads, n, hd), `dtype`) and surprisal of positions < start + end."""
    n = run.start + end
    state = run.track.state
    keys = [state.layer_kv(i, n)[0].to(dtype, copy=True) for i in range(num_layers)]
    values = [state.layer_kv(i, n)[1].to(dtype, copy=True) for i in range(num_layers)]
    surprisal = run.track.surprisal[: max(n - 1, 0)].clone()
    return keys, values, surprisal
