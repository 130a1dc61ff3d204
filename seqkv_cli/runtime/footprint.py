"""What a model costs in memory on the portable path: resident bytes per parameter, and the
peak a capture (or a restore) of n positions should reach, from the model's own numbers.

The parts, largest first on a real model: the weights as the store holds them (the
checkpoint's width, `checkpoint.WeightStore`); fp32 tensors the module keeps (norms,
biases, stacked expert weights); one sequence's `PortableState` (keys and values in fp32,
the definition's integers of both in fp32, an exponent a row); the logits of one prefill chunk in
fp64 and fp32 (a vocabulary of 150k makes this the largest transient); and the process
itself (Python, torch, transformers, numba: `PROCESS_BYTES`, measured on this project's
machines with nothing loaded, docs/BENCHMARKS.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

PROCESS_BYTES = 520 << 20  # Python + torch + transformers + numba imported, no model
PREFILL_CHUNK = 256  # positions a capture or encoder forwards at a time (kvcapture.engine)


@dataclass(frozen=True)
class Footprint:
    parameters: int  # the model's parameters (a tied weight once)
    weights_bytes: int  # the stored weights, as held
    module_bytes: int  # fp32 tensors the module keeps beside them
    state_bytes: int  # one sequence's portable state at `positions`
    logits_bytes: int  # one prefill chunk's logits, fp64 and fp32
    positions: int

    @property
    def bytes_per_parameter(self) -> float:
        return (self.weights_bytes + self.module_bytes) / max(1, self.parameters)

    @property
    def expected_peak(self) -> int:
        return (
            PROCESS_BYTES
            + self.weights_bytes
            + self.module_bytes
            + self.state_bytes
            + self.logits_bytes
        )


def state_bytes(shape, positions: int) -> int:
    """A `PortableState` of ``positions`` on the default path (v3): fp32 keys and values,
    their integers as the state holds them and an int64 exponent per row of each."""
    from seqkv_cli.runtime.portable import exact
    from seqkv_cli.runtime.portable.attention import state_layout

    bits = (exact.L1_KV_BITS, exact.L1_KV_BITS)
    layout = state_layout(
        shape.num_layers, shape.num_kv_heads, shape.head_dim, positions, bits
    ).values()
    return sum(math.prod(dims) * dtype.itemsize for dims, dtype in layout)


def footprint(lm, positions: int = 1000) -> Footprint:
    """The footprint of a `LoadedModel` on the portable path for a sequence of ``positions``."""
    store = lm.weights
    module = lm.module
    seen: set[int] = set()
    module_bytes = 0
    params = 0
    for p in module.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        params += p.numel()
        if not p.is_meta and (store is None or store.find(p) is None):
            module_bytes += p.numel() * p.element_size()
    weights = store.nbytes if store is not None else 0
    if store is None:  # a user's object: its fp32 weights are what is held
        module_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    chunk = min(positions, PREFILL_CHUNK)
    return Footprint(
        parameters=params,
        weights_bytes=weights,
        module_bytes=module_bytes,
        state_bytes=state_bytes(lm.shape, positions),
        logits_bytes=chunk * lm.shape.vocab_size * (8 + 4),
        positions=positions,
    )
