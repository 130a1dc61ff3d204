"""A dispatch mode that runs a model's own transformers code under the portable definition.

Every aten op the model issues is looked up here: ops whose result IEEE fixes everywhere
(views, copies, casts, comparisons, + - * /, √, max/min, gathers) run as they are; ops whose
bits depend on a kernel (matrix products, transcendentals, reductions, softmax, top-k) are
replaced by `exact`; anything else is refused with one line naming it — the path fails closed
rather than run an op whose bits nobody checked.
"""

from __future__ import annotations

import functools

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from seqkv_cli.errors import SeqkvError
from seqkv_cli.runtime.portable import exact, kernels

aten = torch.ops.aten

# Exact on every IEEE machine: data movement, casts (correctly rounded), comparisons, selection,
# and single correctly rounded arithmetic.
_EXACT = {
    "view",
    "_unsafe_view",
    "reshape",
    "t",
    "transpose",
    "permute",
    "expand",
    "unsqueeze",
    "squeeze",
    "slice",
    "select",
    "split",
    "split_with_sizes",
    "unbind",
    "alias",
    "clone",
    "contiguous",
    "cat",
    "stack",
    "detach",
    "lift_fresh",
    "_to_copy",
    "to",
    "type_as",
    "copy",
    "arange",
    "zeros",
    "ones",
    "full",
    "empty",
    "new_ones",
    "new_zeros",
    "new_empty",
    "new_full",
    "zeros_like",
    "ones_like",
    "empty_like",
    "full_like",
    "scalar_tensor",
    "fill",
    "masked_fill",
    "where",
    "embedding",
    "index",
    "index_select",
    "gather",
    "eq",
    "ne",
    "lt",
    "le",
    "gt",
    "ge",
    "logical_and",
    "logical_or",
    "logical_not",
    "bitwise_and",
    "bitwise_or",
    "bitwise_not",
    "neg",
    "abs",
    "mul",
    "div",
    "sqrt",
    "amax",
    "amin",
    "max",
    "min",
    "maximum",
    "minimum",
    "argmax",
    "argmin",
    "clamp",
    "clamp_min",
    "clamp_max",
    "floor",
    "ceil",
    "round",
    "trunc",
    "sign",
    "isnan",
    "isinf",
    "isfinite",
    "any",
    "all",
    "triu",
    "tril",
    "_local_scalar_dense",
    "nonzero",
    "floor_divide",
    "remainder",
    "one_hot",
    "repeat",
    "repeat_interleave",
    "flip",
    "roll",
    "sym_size",
    "sym_stride",
    "sym_numel",
    "is_nonzero",
    "_assert_async",
    "item",
    "resize",
    "set",
    "as_strided",
    "diagonal",
    "narrow",
    "_reshape_alias",
    "empty_strided",
    "new_empty_strided",
    "bitwise_xor",
    "chunk",
    "greater",
    "less",
    "greater_equal",
    "less_equal",
    "not_equal",
    "tensor_split",
    "flatten",
    "unflatten",
    "movedim",
    "swapaxes",
    "expand_as",
    "view_as",
    "reshape_as",
    "masked_select",
    "bincount",
    "searchsorted",
}
# Exact only on integer (or boolean) tensors: a float sum/cumsum depends on its order.
_INTEGER_ONLY = {"cumsum", "prod"}


@functools.cache
def _op_name(func) -> tuple[str, bool]:
    """(base name, in place?) of an aten overload: ``aten::add_.Tensor`` -> ("add", True)."""
    name = func._schema.name.split("::")[-1]
    inplace = name.endswith("_") and not name.startswith("_")
    return (name[:-1] if inplace else name), inplace


def _base_name(func) -> str:
    return _op_name(func)[0]


def _is_float(x) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


class PortableMode(TorchDispatchMode):
    """Runs inside ``with PortableMode(weights):``; ``weights`` caches quantized parameters,
    ``form`` is the definition's form of a product's left operand (`exact.FORMS`)."""

    def __init__(self, weights: WeightCache, model_type: str = "?", form: int = 1) -> None:
        super().__init__()
        self.weights = weights
        self.model_type = model_type
        self.form = form

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name, inplace = _op_name(func)
        handler = _REPLACED.get(name)
        if handler is not None:
            out = handler(self, func, args, kwargs)  # the mode is off inside its own handler
            return args[0].copy_(out) if inplace else out  # in place: the value written back
        if name in ("add", "sub"):
            return _add_sub(func, args, kwargs)
        if name in _INTEGER_ONLY and not any(_is_float(a) for a in args):
            return func(*args, **kwargs)
        if name == "index_put":
            return _index_put(func, args, kwargs)
        if name == "index_add":
            return _index_add(func, args, kwargs)
        if name in _EXACT:
            return func(*args, **kwargs)
        raise SeqkvError(
            f"portable numerics: the {self.model_type} model uses op {func._schema.name}, which "
            "is not vetted to give the same bits on every machine; compress it with --codec "
            "lossless or a per-vector codec (they need no canonical forward)"
        )


class QuantizedWeight:
    """One parameter's quantized rows: the integers as fp64 (what a BLAS product multiplies),
    their exponents, and — made on a native kernel's first use (a step), CPU only — the same
    integers split to 3 bytes a weight (`kernels.split_weights`)."""

    def __init__(self, f64: torch.Tensor, e: torch.Tensor, native: bool) -> None:
        self.f64, self.e, self.native = f64, e, native
        self._ints = None

    @classmethod
    def of(cls, w: torch.Tensor, bits: int) -> QuantizedWeight:
        """``w``'s rows quantized to ``bits`` (`exact.quantize_rows`)."""
        xq, e = exact.quantize_rows(w, bits)
        # The kernel takes one (N, K) matrix of |integers| <= 2**23; stacked (expert) weights
        # and wider integers keep the BLAS product.
        return cls(xq.contiguous(), e, w.device.type == "cpu" and w.dim() == 2 and bits <= 23)

    @classmethod
    def stacked(cls, parts: list[QuantizedWeight]) -> QuantizedWeight:
        """The rows of several weights over the same input as one (a row's integers depend on
        that row alone, so one product gives each part's bits): one pass over x for q, k, v."""
        return cls(
            torch.cat([p.f64 for p in parts]),
            torch.cat([p.e for p in parts]),
            all(p.native for p in parts),
        )

    @property
    def ints(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(hi, lo) for the native kernel, or None where it cannot take this weight."""
        if not self.native or not kernels.enabled():
            return None
        if self._ints is None:
            self._ints = kernels.split_weights(self.f64)
        return self._ints

    def product(self, x: torch.Tensor, bits: int, form: int) -> torch.Tensor:
        """Exact fp64 ``x @ Wᵀ`` in the portable definition (`exact.fixed_product`'s bits)."""
        if self.native and exact.native_product(x, form):
            return exact.kernel_product(x, bits, self.ints, self.e, form)
        return exact.fixed_product(x, bits, self.f64, self.e, form)


class WeightCache:
    """Quantized rows of the model's parameters, made once (they never change in inference)."""

    def __init__(self, model) -> None:
        self._owners = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self._owners |= {b.untyped_storage().data_ptr() for b in model.buffers()}
        self._cache: dict[tuple, QuantizedWeight] = {}

    def rows(self, w: torch.Tensor, bits: int) -> QuantizedWeight:
        """``w``'s rows quantized to ``bits``, cached when ``w`` is (a view of) a parameter."""
        if w.untyped_storage().data_ptr() not in self._owners:
            return QuantizedWeight.of(w, bits)
        key = self._key(w, bits)
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = QuantizedWeight.of(w, bits)
        return hit

    def stacked(self, ws: list[torch.Tensor], bits: int) -> QuantizedWeight:
        """`QuantizedWeight.stacked` of parameters, cached; their single entries are dropped
        (the stacked copy serves every call that reads them together)."""
        key = ("stacked", *(self._key(w, bits) for w in ws))
        hit = self._cache.get(key)
        if hit is None:
            singles = [self._cache.pop(self._key(w, bits), None) for w in ws]
            if all(singles):  # quantized already (the probe's reference run): reuse them
                hit = QuantizedWeight.stacked(singles)
            else:  # rows quantize alone: the stacked rows' integers are the singles'
                hit = QuantizedWeight.of(torch.cat(ws), bits)
            self._cache[key] = hit
        return hit

    @staticmethod
    def _key(w: torch.Tensor, bits: int) -> tuple:
        ptr = w.untyped_storage().data_ptr()
        return (ptr, w.storage_offset(), tuple(w.shape), tuple(w.stride()), bits)


def _matmul(mode: PortableMode, a: torch.Tensor, b: torch.Tensor, dtype) -> torch.Tensor:
    k = a.shape[-1]
    if k == 1:
        return exact.matmul(a, b).to(dtype)
    bits = exact.right_bits(k, mode.form)
    return mode.weights.rows(b.transpose(-1, -2), bits).product(a, bits, mode.form).to(dtype)


def _mm(mode, func, args, kwargs):
    a, b = args[0], args[1]
    return _matmul(mode, a, b, a.dtype)


def _addmm(mode, func, args, kwargs):
    bias, a, b = args[0], args[1], args[2]
    if kwargs.get("beta", 1) != 1 or kwargs.get("alpha", 1) != 1:
        raise SeqkvError("portable numerics: addmm with beta/alpha is not vetted")
    out = _matmul(mode, a, b, torch.float64) + bias.to(torch.float64)
    return out.to(a.dtype)


def _linear(mode, func, args, kwargs):
    x, w = args[0], args[1]
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    bits = exact.right_bits(x.shape[-1], mode.form)
    # rows of W are the contraction vectors already
    out = mode.weights.rows(w, bits).product(x, bits, mode.form)
    if bias is not None:
        out = out + bias.to(torch.float64)
    return out.to(x.dtype)


def _general_matmul(mode, func, args, kwargs):
    a, b = args[0], args[1]
    if a.dim() < 2 or b.dim() < 2:
        raise SeqkvError("portable numerics: matmul of vectors is not vetted")
    return _matmul(mode, a, b, a.dtype)


def _unary(fn):
    return lambda mode, func, args, kwargs: fn(args[0])


def _gelu(mode, func, args, kwargs):
    approximate = kwargs.get("approximate", args[1] if len(args) > 1 else "none")
    if approximate != "tanh":
        raise SeqkvError(
            "portable numerics: exact (erf) GELU is not vetted yet; models with "
            "gelu_pytorch_tanh / gelu_new are supported"
        )
    return exact.gelu_tanh(args[0])


def _pow(mode, func, args, kwargs):
    base, exponent = args[0], args[1]
    like = base if isinstance(base, torch.Tensor) else exponent
    return exact.pow_(base, exponent, like.dtype)


def _softmax_args(args, kwargs):
    x, dim = args[0], kwargs.get("dim", args[1] if len(args) > 1 else -1)
    third = args[2] if len(args) > 2 else kwargs.get("dtype", kwargs.get("half_to_float"))
    # softmax(x, dim, dtype) names a dtype; _softmax(x, dim, half_to_float) a flag.
    dtype = third if isinstance(third, torch.dtype) else (torch.float32 if third else None)
    return x, dim, dtype


def _softmax(mode, func, args, kwargs):
    return exact.softmax(*_softmax_args(args, kwargs))


def _log_softmax(mode, func, args, kwargs):
    return exact.log_softmax(*_softmax_args(args, kwargs))


def _dropout(mode, func, args, kwargs):
    train = args[2] if len(args) > 2 else kwargs.get("train", False)
    if train:
        raise SeqkvError("portable numerics: dropout in training mode is random; call .eval()")
    return args[0]


def _reduce(mean: bool):
    def run(mode, func, args, kwargs):
        x = args[0]
        if not x.is_floating_point():
            return func(*args, **kwargs)
        dims = args[1] if len(args) > 1 else kwargs.get("dim")
        keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
        dtype = kwargs.get("dtype") or x.dtype
        dims = list(range(x.dim())) if dims is None or dims == [] else list(dims)
        dims = sorted(d % x.dim() for d in dims)
        out = x.to(torch.float64)
        count = 1
        for d in reversed(dims):
            count *= out.shape[d]
            out = exact.tree_sum(out, d, keepdim=True)
        if mean:
            out = out / count
        if not keepdim:
            for d in reversed(dims):
                out = out.squeeze(d)
        return out.to(dtype)

    return run


def _topk(mode, func, args, kwargs):
    """Top-k by a stable sort: ties go to the lower index on every machine."""
    x, k = args[0], args[1]
    dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
    largest = args[3] if len(args) > 3 else kwargs.get("largest", True)
    values, idx = torch.sort(x, dim=dim, descending=largest, stable=True)
    return values.narrow(dim, 0, k).contiguous(), idx.narrow(dim, 0, k).contiguous()


def _sort(mode, func, args, kwargs):
    """Sorts are stable: equal keys keep their index order on every machine."""
    x = args[0]
    dim = kwargs.get("dim", args[1] if len(args) > 1 else -1)
    descending = kwargs.get("descending", args[2] if len(args) > 2 else False)
    return torch.sort(x, dim=dim, descending=descending, stable=True)


def _add_sub(func, args, kwargs):
    alpha = kwargs.get("alpha", 1)
    if alpha == 1:
        return func(*args, **kwargs)
    # add(a, b, alpha) may fuse a multiply-add in vectorised code: split it into two ops.
    a, b = args[0], args[1]
    scaled = torch.mul(b, alpha)
    return torch.add(a, scaled) if _base_name(func) == "add" else torch.sub(a, scaled)


def _index_put(func, args, kwargs):
    accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
    if accumulate and _is_float(args[0]):
        raise SeqkvError("portable numerics: index_put with accumulate on floats is not vetted")
    return func(*args, **kwargs)


def _index_add(func, args, kwargs):
    """Exact when no index repeats (one add per element); repeats would sum in any order."""
    index = args[2]
    if _is_float(args[0]) and int(index.unique().numel()) != int(index.numel()):
        raise SeqkvError("portable numerics: index_add with repeated indices is not vetted")
    return func(*args, **kwargs)


_REPLACED = {
    "linear": _linear,
    "matmul": _general_matmul,
    "mm": _mm,
    "bmm": _mm,
    "addmm": _addmm,
    "exp": _unary(exact.exp),
    "log": _unary(exact.log),
    "sin": _unary(exact.sin),
    "cos": _unary(exact.cos),
    "tanh": _unary(exact.tanh),
    "sigmoid": _unary(exact.sigmoid),
    "silu": _unary(exact.silu),
    "rsqrt": _unary(exact.rsqrt),
    "reciprocal": _unary(lambda x: (1.0 / x.to(torch.float64)).to(x.dtype)),
    "gelu": _gelu,
    "pow": _pow,
    "_softmax": _softmax,
    "softmax": _softmax,
    "_log_softmax": _log_softmax,
    "log_softmax": _log_softmax,
    "dropout": _dropout,
    "mean": _reduce(mean=True),
    "sum": _reduce(mean=False),
    "topk": _topk,
    "sort": _sort,
}
