"""A dispatch mode that runs a model's own transformers code under the portable definition.

Every aten op the model issues is looked up in `op_policy.OP_POLICY` (run as it is, run
under a condition, or replaced by the definition); an op the table does not name is refused
with one line naming it.
"""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode

from seqkv_cli.errors import SeqkvError
from seqkv_cli.runtime.portable.op_policy import OP_POLICY, VIEW_OPS, as_is, op_name, refusal
from seqkv_cli.runtime.portable.weights import WeightCache


class PortableMode(TorchDispatchMode):
    """Runs inside ``with PortableMode(weights):``; ``weights`` caches quantized parameters,
    ``form`` is the definition's form of a product's left operand (`exact.FORMS`)."""

    def __init__(self, weights: WeightCache, model_type: str = "?", form: int = 1) -> None:
        super().__init__()
        self.weights = weights
        self.model_type = model_type
        self.form = form

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = op_name(func)[0]
        rule = OP_POLICY.get(name)
        if rule is None:
            raise refusal(self, func)
        if rule is as_is and name not in VIEW_OPS and _reads_meta(args):
            # A weight held at the checkpoint's width stands in the module as a meta tensor:
            # only products and lookups may read it (they go through `weights`).
            raise SeqkvError(
                f"portable numerics: the {self.model_type} model reads a weight's values with "
                f"op {func._schema.name}, which the weights held at the checkpoint's width do "
                "not support; compress it with --codec lossless or a per-vector codec"
            )
        return rule(self, func, args, kwargs or {})  # the mode is off inside its own rule


def _reads_meta(args) -> bool:
    for a in args:
        if isinstance(a, list | tuple):
            if any(getattr(b, "is_meta", False) for b in a):
                return True
        elif getattr(a, "is_meta", False):
            return True
    return False
