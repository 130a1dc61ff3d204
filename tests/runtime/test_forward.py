"""Both canonical forwards keep the one contract of runtime/forward.py, and refuse alike."""

from __future__ import annotations

import pytest
import torch

from seqkv_cli.runtime.forward import CanonicalForward, ForwardState
from seqkv_cli.runtime.legacy import CanonicalLM, check_row_invariance
from seqkv_cli.runtime.numerics import DEFAULT, build_canonical


@pytest.fixture(scope="module", params=["portable", "legacy"])
def forward(request, tiny_lm):
    if request.param == "legacy":
        return CanonicalLM(tiny_lm.fp32_model())
    return build_canonical(tiny_lm.fp32_model(), DEFAULT)


def test_each_forward_is_a_canonical_forward_with_states(forward):
    assert isinstance(forward, CanonicalForward)
    state = forward.new_state(8)
    assert isinstance(state, ForwardState) and (state.length, state.capacity) == (0, 8)
    logits = forward.forward(state, torch.tensor([3, 4, 5]))
    assert logits.shape == (3, forward.vocab_size) and state.length == 3
    keys, values = state.layer_kv(0)
    assert keys.shape == (forward.num_kv_heads, 3, forward.head_dim) == values.shape
    branch = state.fork(2, 8)
    assert branch.length == 2 and torch.equal(branch.layer_kv(0)[0], keys[:, :2])
    # stepped from the fork, the third token gets the bits the prefill gave it (the legacy
    # path promises that only where this machine's BLAS is row-invariant)
    stepped = forward.forward(branch, torch.tensor([5]))[0]
    if isinstance(forward, CanonicalLM) and not check_row_invariance():
        return
    assert torch.equal(stepped, logits[2])


def test_each_forward_refuses_a_batch_the_same_way(forward):
    a, b = forward.new_state(4), forward.new_state(4)
    with pytest.raises(ValueError, match="each sequence may appear once per forward_rows call"):
        forward.forward_rows([a, a], [1, 2])
    with pytest.raises(ValueError, match="each sequence may appear once per forward_many call"):
        forward.forward_many([b, b], [[1], [2]])
    with pytest.raises(ValueError, match="forward_many needs at least one token per sequence"):
        forward.forward_many([a, b], [[1], []])
    assert (a.length, b.length) == (0, 0)
