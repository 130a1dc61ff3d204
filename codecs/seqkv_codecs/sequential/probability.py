"""Deterministic integer frequency tables built from model logits.

Encoder and decoder must derive the *same* integers from the same float logits, whether
they run numpy or torch, on CPU or GPU. ``exp`` differs between math libraries in the last
bit, so the only float operations here are one IEEE subtraction and one IEEE
multiplication (correctly rounded on every platform); the exponential itself is an integer
table lookup and a shift. Everything after that is exact int64 arithmetic. Any change to
this construction changes coded bytes and must bump the format version (docs/RANGE_CODER.md).
"""

from __future__ import annotations

import functools
from decimal import Decimal, localcontext
from operator import index
from typing import TYPE_CHECKING

import numpy as np

from seqkv_codecs.errors import CodecError

if TYPE_CHECKING:
    import torch

MAX_PRECISION_BITS = 31
FRACTION_BITS = 10  # logit differences are quantised to 1/1024 of a bit
WEIGHT_BITS = 32  # the most likely symbol weighs exactly 2**32
LOG2E_SCALED = float.fromhex("0x1.71547652b82fep+10")  # float64(log2 e) * 2**10, exact
MAX_STEPS = (WEIGHT_BITS + 1) << FRACTION_BITS  # at 2**-33 of the top weight every weight is 0
_FRACTION_MASK = (1 << FRACTION_BITS) - 1


@functools.cache
def exp2_table() -> np.ndarray:
    """``T[j] = round(2**32 * 2**(-j / 1024))`` for j in [0, 1024), read-only int64.

    Computed in 50-digit decimal arithmetic (libmpdec is platform independent), so the table
    is a constant of the format rather than of the machine's libm.
    """
    with localcontext() as ctx:
        ctx.prec = 50
        step = Decimal(2).ln() / (1 << FRACTION_BITS)
        scale = Decimal(1 << WEIGHT_BITS)
        values = [int((scale * (-step * j).exp()).to_integral_value()) for j in range(1024)]
    table = np.array(values, dtype=np.int64)
    table.setflags(write=False)
    return table


def _spare_mass(vocab: int, precision_bits: int, floor: int) -> int:
    """Validate the arguments and return 2**P - V*floor, the mass shared out by probability."""
    if isinstance(precision_bits, bool) or not 1 <= precision_bits <= MAX_PRECISION_BITS:
        raise CodecError(f"precision_bits must be in 1..{MAX_PRECISION_BITS}, got {precision_bits}")
    if index(floor) < 1:
        raise CodecError(f"floor must be >= 1 so every symbol stays codable, got {floor}")
    if vocab < 1 or vocab * floor >= 1 << precision_bits:
        raise CodecError(
            f"{vocab} symbols with floor {floor} do not fit in 2**{precision_bits}; "
            "raise precision_bits"
        )
    return (1 << precision_bits) - vocab * floor


def frequencies_from_logits(
    logits: np.ndarray, precision_bits: int = 24, floor: int = 1
) -> np.ndarray:
    """Integer frequencies over the last axis: each >= floor, each row summing to 2**P.

    ``logits`` has shape ``(V,)`` or ``(..., V)``; rows are independent, so a batch gives
    the same integers as its rows one at a time. ``-inf`` entries (masked tokens) get the
    floor; NaN, +inf, or a row that is entirely -inf raise ``CodecError``.
    """
    x = np.asarray(logits)
    if x.ndim < 1 or x.dtype.kind != "f":
        raise CodecError(f"logits must be a float array with a vocabulary axis, not {x.dtype}")
    spare = _spare_mass(x.shape[-1], precision_bits, floor)
    x = x.astype(np.float64)  # exact for float16/float32
    if np.isnan(x).any() or np.isposinf(x).any():
        raise CodecError("logits contain NaN or +inf; the model step is broken")
    top = x.max(axis=-1, keepdims=True)
    if not np.isfinite(top).all():
        raise CodecError("a row of logits is entirely -inf; there is no distribution to code")
    steps = np.minimum((top - x) * LOG2E_SCALED, MAX_STEPS).astype(np.int64)
    weights = exp2_table()[steps & _FRACTION_MASK] >> (steps >> FRACTION_BITS)
    share = weights * spare // weights.sum(axis=-1, keepdims=True)
    freqs = share + floor
    leftover = spare - share.sum(axis=-1, keepdims=True)
    first_top = np.argmax(weights, axis=-1)[..., None]  # numpy: first index of the maximum
    np.put_along_axis(freqs, first_top, np.take_along_axis(freqs, first_top, -1) + leftover, -1)
    return freqs


@functools.cache
def _torch_table(device: torch.device) -> torch.Tensor:
    import torch

    return torch.tensor(exp2_table().tolist(), dtype=torch.int64, device=device)


def frequencies_from_logits_torch(
    logits: torch.Tensor, precision_bits: int = 24, floor: int = 1
) -> torch.Tensor:
    """Torch twin of :func:`frequencies_from_logits`: identical int64 values, on logits.device."""
    import torch

    if logits.ndim < 1 or not logits.is_floating_point():
        raise CodecError(
            f"logits must be a float tensor with a vocabulary axis, got {logits.dtype}"
        )
    spare = _spare_mass(logits.shape[-1], precision_bits, floor)
    x = logits.to(torch.float64)
    if bool(torch.isnan(x).any()) or bool(torch.isposinf(x).any()):
        raise CodecError("logits contain NaN or +inf; the model step is broken")
    top = x.amax(dim=-1, keepdim=True)
    if not bool(torch.isfinite(top).all()):
        raise CodecError("a row of logits is entirely -inf; there is no distribution to code")
    steps = ((top - x) * LOG2E_SCALED).clamp_max(MAX_STEPS).to(torch.int64)
    weights = _torch_table(x.device)[steps & _FRACTION_MASK] >> (steps >> FRACTION_BITS)
    share = torch.div(weights * spare, weights.sum(dim=-1, keepdim=True), rounding_mode="floor")
    freqs = share + floor
    leftover = spare - share.sum(dim=-1, keepdim=True)
    # First index whose step is 0 (= first maximal weight), spelled without argmax tie rules.
    index = torch.arange(x.shape[-1], device=x.device)
    first_top = torch.where(steps == 0, index, x.shape[-1]).amin(dim=-1, keepdim=True)
    return freqs.scatter_add_(-1, first_top, leftover)


def cumulative(freqs: np.ndarray) -> np.ndarray:
    """Cumulative table with a leading 0: ``cdf[..., s] <= target < cdf[..., s + 1]`` picks s."""
    f = np.asarray(freqs, dtype=np.int64)
    zeros = np.zeros((*f.shape[:-1], 1), dtype=np.int64)
    return np.concatenate([zeros, np.cumsum(f, axis=-1)], axis=-1)


def code_length_bits(freqs: np.ndarray, symbols: np.ndarray) -> float:
    """Ideal cost, sum of -log2(f[s] / row total), of coding ``symbols`` under ``freqs``.

    ``freqs`` is one table ``(V,)`` used for every symbol, or one row per symbol ``(..., V)``
    with ``symbols`` of shape ``(...)``.
    """
    f = np.asarray(freqs, dtype=np.int64)
    s = np.asarray(symbols, dtype=np.int64)
    if f.ndim < 1 or ((s < 0) | (s >= f.shape[-1])).any():
        raise CodecError(f"symbols must lie in [0, {f.shape[-1] if f.ndim else 0})")
    if f.ndim == 1:
        picked, totals = f[s], f.sum()
    elif f.shape[:-1] == s.shape:
        picked, totals = np.take_along_axis(f, s[..., None], -1)[..., 0], f.sum(axis=-1)
    else:
        raise CodecError(f"freqs {f.shape} and symbols {s.shape} do not line up")
    if (picked <= 0).any():
        raise CodecError("a symbol has zero frequency; it cannot be coded")
    return float(np.sum(np.log2(totals) - np.log2(picked)))
