"""A dispatch mode that runs a model's own transformers code under the portable definition.

Every aten op the model issues is looked up in `op_policy.OP_POLICY` (run as it is, run
under a condition, or replaced by the definition); an op the table does not name is refused
with one line naming it.
"""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode

from seqkv_cli.runtime.portable.op_policy import OP_POLICY, op_name, refusal
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
        rule = OP_POLICY.get(op_name(func)[0])
        if rule is None:
            raise refusal(self, func)
        return rule(self, func, args, kwargs or {})  # the mode is off inside its own rule
