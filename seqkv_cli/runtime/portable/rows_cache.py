"""The transformers `Cache` of a portable forward: each batch row's K/V into its own state.

Each row of a forward is a sequence of its own (a trie branch, a session of a batch), with
its own `PortableState` at its own length, so no one length or mask describes the rows:
transformers builds no mask for an attention it has no mask function for, and seqkv's
registered attention (`attention.portable_attention`) masks each row from its absolute
positions. Written against the cache API that transformers 5.0.0 and later share.
"""

from __future__ import annotations

from torch.utils._python_dispatch import _disable_current_modes
from transformers.cache_utils import Cache, CacheLayerMixin

from seqkv_cli.runtime.portable.attention import PortableState


class RowsLayer(CacheLayerMixin):
    """One decoder layer of the rows: `update` writes each row's new K/V into its state.

    The storage is the states' preallocated buffers, so the mixin's ``keys``/``values`` stay
    unset; the attention reads the states, not what `update` returns.
    """

    is_compileable = False
    is_sliding = False  # a window is applied by the attention, from absolute positions

    def __init__(self, states: list[PortableState], layer_idx: int) -> None:
        super().__init__()
        self.states = states
        self.layer_idx = layer_idx

    def lazy_initialization(self, key_states, value_states) -> None:
        """Nothing to allocate: the states were allocated to their capacity."""

    def update(self, key_states, value_states, *args, **kwargs):
        with _disable_current_modes():  # seqkv's own bookkeeping, not model ops
            for row, state in enumerate(self.states):
                state.write(self.layer_idx, key_states[row].float(), value_states[row].float())
        return key_states, value_states

    def get_seq_length(self) -> int:
        # The first row's: transformers numbers `cache_position` from it, which the portable
        # path never reads (positions come from `position_ids`, one per row).
        return self.states[0].length

    def get_mask_sizes(self, query) -> tuple[int, int]:
        # `cache_position` (transformers 5.0.0) or the query length (later); unused while
        # the registered attention has no mask function.
        q = query if isinstance(query, int) else int(query.shape[0])
        return self.get_seq_length() + q, 0

    def get_max_cache_shape(self) -> int:  # transformers 5.0.0's name
        return -1  # no one maximum: each row has its own state's capacity

    def get_max_length(self) -> int:  # later transformers' name
        return -1


class RowsCache(Cache):
    """The cache transformers sees during one portable forward of ``states`` (one per row)."""

    def __init__(self, states: list[PortableState]) -> None:
        layers = int(states[0].keys.shape[0])
        super().__init__(layers=[RowsLayer(states, i) for i in range(layers)])
        self.states = states

    def crop(self, tokens: int) -> None:
        """transformers' rollback, in the convention 5.0.0 and later share: a negative
        ``tokens`` forgets that many positions at the end of every row (`PortableState.crop`).
        Rows share one length per sequence, not per layer, so this crops each state once."""
        for state in self.states:
            state.crop(tokens)
