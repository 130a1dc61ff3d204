"""`CanonicalForward`: the contract every layer above the runtime codes against.

A canonical forward is a model run whose logits and K/V are the same bits however a sequence
is cut into calls (one prefill, chunks, a token at a time, several sequences side by side), so
an encoder that prefills and a decoder that steps see the same distributions. It holds
sequences in states (`ForwardState`): fixed-capacity K/V buffers that can be forked at a
branch point (a trie node) and cropped.

Two forwards implement it: the portable paths (`runtime/portable`, `PortableLM`: the same bits
on every machine) and the legacy path (`runtime/legacy.py`, `CanonicalLM`: the same bits on
one machine class, kept so that its files still decode). `numerics.build_canonical` makes
the one a numeric path names. The codec library states its side of the same contract as
`seqkv_codecs.sequential.logits_model.LogitsModel`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class ForwardState(Protocol):
    """One sequence's K/V in a canonical forward: `length` positions of `capacity`."""

    length: int
    capacity: int

    def layer_kv(self, layer: int, n: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer's first `n` positions (default all): (kv_heads, n, head_dim)."""
        ...

    def fork(self, length: int, capacity: int) -> ForwardState:
        """A new state holding this one's first `length` positions (a branch point)."""
        ...

    def crop(self, tokens: int) -> None:
        """Forget the last `-tokens` positions (transformers' `Cache.crop` convention)."""
        ...


@runtime_checkable
class CanonicalForward(Protocol):
    """Logits and K/V that do not depend on how a sequence is cut into calls."""

    numeric_path: str  # the name files record (docs/NUMERICS.md)
    vocab_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_context: int

    def new_state(self, capacity: int) -> ForwardState: ...

    def forward(self, state: ForwardState, token_ids: torch.Tensor) -> torch.Tensor:
        """Append `token_ids` (M,) to `state`; their next-token logits (M, vocab), fp32."""
        ...

    def forward_rows(self, states: list[ForwardState], token_ids: list[int]) -> torch.Tensor:
        """Append one token to each of several sequences in one pass; logits (B, vocab), each
        row the bits it would have stepped alone."""
        ...

    def forward_many(self, states: list[ForwardState], token_ids: list) -> list[torch.Tensor]:
        """Append token_ids[i] (one or more) to states[i] in one pass; logits (m_i, vocab)."""
        ...

    def surprisal(self, logits: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        """Bits of each next token under `logits`, computed as this path defines them."""
        ...


def check_batch(
    states: Sequence[object], token_ids: Sequence | None = None, call: str = ""
) -> None:
    """What every forward refuses in a batched call: a sequence given twice (its K/V would be
    written twice in one pass) and, for `forward_many`, a sequence given no token."""
    if len({id(s) for s in states}) != len(states):
        raise ValueError(f"each sequence may appear once per {call} call")
    if token_ids is not None and (not token_ids or min(len(ids) for ids in token_ids) == 0):
        raise ValueError(f"{call} needs at least one token per sequence")
