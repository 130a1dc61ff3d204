"""The portable path's op policy: what each aten op a model issues becomes, in one table.

`OP_POLICY` maps an op's base name (``add_`` and ``add`` alike) to its rule. Ops whose result
IEEE fixes everywhere (views, copies, casts, comparisons, + - * /, √, max/min, gathers) run
as they are; a few run as they are under a condition (integer inputs, no repeated index, no
fused alpha); ops whose bits depend on a kernel (matrix products, transcendentals, reductions,
softmax, top-k) are replaced by the definition (`exact`, `elementary`, the cached weights).
An op missing from the table is refused (`refusal`): the path fails closed rather than run
an op whose bits nobody checked. `mode.PortableMode` applies the table.
"""

from __future__ import annotations

import functools

import torch

from seqkv_cli.errors import SeqkvError
from seqkv_cli.runtime.portable import elementary, exact

# A rule: (mode, func, args, kwargs) -> the op's result, with the dispatch mode off.


@functools.cache
def op_name(func) -> tuple[str, bool]:
    """(base name, in place?) of an aten overload: ``aten::add_.Tensor`` -> ("add", True)."""
    name = func._schema.name.split("::")[-1]
    inplace = name.endswith("_") and not name.startswith("_")
    return (name[:-1] if inplace else name), inplace


def refusal(mode, func) -> SeqkvError:
    """The one-line refusal of an op the table does not vet."""
    return SeqkvError(
        f"portable numerics: the {mode.model_type} model uses op {func._schema.name}, which "
        "is not vetted to give the same bits on every machine; compress it with --codec "
        "lossless or a per-vector codec (they need no canonical forward)"
    )


def _is_float(x) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


def as_is(mode, func, args, kwargs):
    """Exact on every IEEE machine: the op itself."""
    return func(*args, **kwargs)


def replaced(compute):
    """The op's value computed in the definition; an in-place op gets it written back."""

    def rule(mode, func, args, kwargs):
        out = compute(mode, func, args, kwargs)
        return args[0].copy_(out) if op_name(func)[1] else out

    return rule


def _integer_only(mode, func, args, kwargs):
    """Exact only on integer (or boolean) tensors: a float sum/cumsum depends on its order."""
    if any(_is_float(a) for a in args):
        raise refusal(mode, func)
    return func(*args, **kwargs)


def _matmul(mode, a: torch.Tensor, b: torch.Tensor, dtype) -> torch.Tensor:
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


def _embedding(mode, func, args, kwargs):
    """A lookup in a stored weight decodes the rows it needs (the module holds a meta tensor
    in its place); any other table is gathered as it is."""
    weight, indices = args[0], args[1]
    if mode.weights.stored(weight) is None:
        return func(*args, **kwargs)
    return mode.weights.embedding(weight, indices)


def _unary(fn):
    return lambda mode, func, args, kwargs: fn(args[0])


def _gelu(mode, func, args, kwargs):
    approximate = kwargs.get("approximate", args[1] if len(args) > 1 else "none")
    return (elementary.gelu_tanh if approximate == "tanh" else elementary.gelu_erf)(args[0])


def _pow(mode, func, args, kwargs):
    base, exponent = args[0], args[1]
    like = base if isinstance(base, torch.Tensor) else exponent
    return elementary.power(base, exponent, like.dtype)


def _softmax_args(args, kwargs):
    x, dim = args[0], kwargs.get("dim", args[1] if len(args) > 1 else -1)
    third = args[2] if len(args) > 2 else kwargs.get("dtype", kwargs.get("half_to_float"))
    # softmax(x, dim, dtype) names a dtype; _softmax(x, dim, half_to_float) a flag.
    dtype = third if isinstance(third, torch.dtype) else (torch.float32 if third else None)
    return x, dim, dtype


def _softmax(mode, func, args, kwargs):
    return elementary.softmax(*_softmax_args(args, kwargs))


def _log_softmax(mode, func, args, kwargs):
    return elementary.log_softmax(*_softmax_args(args, kwargs))


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
            out = elementary.tree_sum(out, d, keepdim=True)
        if mean:
            out = out / count
        if not keepdim:
            for d in reversed(dims):
                out = out.squeeze(d)
        return out.to(dtype)

    return run


def _layer_norm(mode, func, args, kwargs):
    """native_layer_norm in fp64: the mean and the (biased) variance by the fixed tree, one
    correctly rounded square root, the affine in fp64, one rounding to the input's dtype.
    Returns (out, mean, rstd) as the op does."""
    x, shape = args[0], list(args[1])
    weight = args[2] if len(args) > 2 else kwargs.get("weight")
    bias = args[3] if len(args) > 3 else kwargs.get("bias")
    eps = args[4] if len(args) > 4 else kwargs.get("eps", 1e-5)
    dims = list(range(x.dim() - len(shape), x.dim()))
    a = exact.f64(x).flatten(dims[0]) if dims else exact.f64(x)
    n = a.shape[-1]
    mean = elementary.tree_sum(a, -1, keepdim=True) / n
    centred = a - mean
    variance = elementary.tree_sum(centred * centred, -1, keepdim=True) / n
    rstd = 1.0 / torch.sqrt(variance + eps)
    out = (centred * rstd).view(x.shape)
    if weight is not None:
        out = out * weight.to(torch.float64)
    if bias is not None:
        out = out + bias.to(torch.float64)
    stat_shape = list(x.shape[: x.dim() - len(shape)]) + [1] * len(shape)
    stat_dtype = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    return (
        out.to(x.dtype),
        mean.view(stat_shape).to(stat_dtype),
        rstd.view(stat_shape).to(stat_dtype),
    )


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


def _add_sub(mode, func, args, kwargs):
    alpha = kwargs.get("alpha", 1)
    if alpha == 1:
        return func(*args, **kwargs)
    # add(a, b, alpha) may fuse a multiply-add in vectorised code: split it into two ops.
    a, b = args[0], args[1]
    scaled = torch.mul(b, alpha)
    return torch.add(a, scaled) if op_name(func)[0] == "add" else torch.sub(a, scaled)


def _rsub(mode, func, args, kwargs):
    """rsub(a, b, alpha) is b - alpha * a: one rounding when alpha is 1 (Llama 3's rotary
    table computes ``1 - smooth``), else split like `_add_sub`."""
    alpha = kwargs.get("alpha", args[2] if len(args) > 2 else 1)
    if alpha == 1:
        return func(*args, **kwargs)
    return torch.sub(args[1], torch.mul(args[0], alpha))


def _index_put(mode, func, args, kwargs):
    accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
    if accumulate and _is_float(args[0]):
        raise SeqkvError("portable numerics: index_put with accumulate on floats is not vetted")
    return func(*args, **kwargs)


def _index_add(mode, func, args, kwargs):
    """Exact when no index repeats (one add per element); repeats would sum in any order."""
    index = args[2]
    if _is_float(args[0]) and int(index.unique().numel()) != int(index.numel()):
        raise SeqkvError("portable numerics: index_add with repeated indices is not vetted")
    return func(*args, **kwargs)


# Exact on every IEEE machine: data movement, casts (correctly rounded), comparisons, selection,
# and single correctly rounded arithmetic.
_EXACT_OPS = """
    view _unsafe_view _reshape_alias reshape t numpy_T transpose permute expand expand_as view_as
    reshape_as unsqueeze squeeze slice select split split_with_sizes tensor_split chunk unbind
    alias as_strided diagonal narrow flatten unflatten movedim swapaxes resize set
    clone contiguous cat stack detach lift_fresh _to_copy to type_as copy
    arange zeros ones full empty empty_strided new_ones new_zeros new_empty new_full
    new_empty_strided zeros_like ones_like empty_like full_like scalar_tensor fill
    masked_fill where index index_select gather masked_select nonzero one_hot
    repeat repeat_interleave flip roll triu tril bincount searchsorted
    eq ne lt le gt ge greater less greater_equal less_equal not_equal
    logical_and logical_or logical_not bitwise_and bitwise_or bitwise_not bitwise_xor
    neg abs mul div sqrt square floor_divide remainder
    amax amin max min maximum minimum argmax argmin clamp clamp_min clamp_max relu
    floor ceil round trunc sign isnan isinf isfinite any all
    _local_scalar_dense item is_nonzero _assert_async sym_size sym_stride sym_numel
""".split()  # noqa: SIM905 (names grouped by kind, a line each)

# Ops that only look at a tensor's shape (views, aliases): a weight the module holds as a meta
# tensor may pass through them on its way to a product or a lookup (`mode.PortableMode`).
VIEW_OPS = frozenset(
    """view _unsafe_view _reshape_alias reshape t numpy_T transpose permute expand alias as_strided
    unsqueeze squeeze slice select detach lift_fresh""".split()  # noqa: SIM905 (a list of names)
)

OP_POLICY = {
    **dict.fromkeys(_EXACT_OPS, as_is),
    # Exact under a condition, checked per call (else refused).
    "add": _add_sub,
    "sub": _add_sub,
    "rsub": _rsub,
    "cumsum": _integer_only,
    "prod": _integer_only,
    "index_put": _index_put,
    "index_add": _index_add,
    "embedding": _embedding,
    # Replaced by the definition: products, transcendentals, reductions, softmax, sorting.
    "linear": replaced(_linear),
    "matmul": replaced(_general_matmul),
    "mm": replaced(_mm),
    "bmm": replaced(_mm),
    "addmm": replaced(_addmm),
    "exp": replaced(_unary(elementary.exp)),
    "log": replaced(_unary(elementary.log)),
    "sin": replaced(_unary(elementary.sin)),
    "cos": replaced(_unary(elementary.cos)),
    "tanh": replaced(_unary(elementary.tanh)),
    "erf": replaced(_unary(elementary.erf)),
    "sigmoid": replaced(_unary(elementary.sigmoid)),
    "silu": replaced(_unary(elementary.silu)),
    "rsqrt": replaced(_unary(elementary.rsqrt)),
    "reciprocal": replaced(_unary(lambda x: (1.0 / x.to(torch.float64)).to(x.dtype))),
    "gelu": replaced(_gelu),
    "pow": replaced(_pow),
    "_softmax": replaced(_softmax),
    "softmax": replaced(_softmax),
    "_log_softmax": replaced(_log_softmax),
    "log_softmax": replaced(_log_softmax),
    "dropout": replaced(_dropout),
    "mean": replaced(_reduce(mean=True)),
    "sum": replaced(_reduce(mean=False)),
    "native_layer_norm": _layer_norm,
    "layer_norm": lambda mode, func, args, kwargs: _layer_norm(mode, func, args, kwargs)[0],
    "topk": replaced(_topk),
    "sort": replaced(_sort),
}
