"""A model's weights held once, at the width its checkpoint stores them (docs/NUMERICS.md,
"Weights at their stored width"): the formats, the store, and the two loaders."""

from seqkv_cli.runtime.checkpoint.formats import KINDS, Kind
from seqkv_cli.runtime.checkpoint.store import StoredTensor, WeightStore, weight_names

__all__ = ["KINDS", "Kind", "StoredTensor", "WeightStore", "weight_names"]
