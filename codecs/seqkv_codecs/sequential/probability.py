"""Deterministic integer frequency tables built from model logits.

Encoder and decoder must derive the *same* integers from the same float logits, whether
they run numpy or torch, on CPU or GPU. ``exp`` differs between math libraries in the last
bit, so the only float operations here are one IEEE subtraction and one IEEE
multiplication (correctly rounded on every platform); the exponential itself is an integer
table lookup and a shift. Everything after that is exact int64 arithmetic. Any change to
this construction changes coded bytes and must bump the format version (docs/format/RANGE_CODER.md).

`reference_frequencies` is the construction as whole-row numpy operations (the definition);
the coder's hot paths (`frequencies_from_logits`, `intervals_from_logits`, `find_symbol`)
run it compiled by numba (row_jit.py: the same integers from four plain loops a row, no
float64 copy of the logits) and fall back to numpy where numba cannot be imported or
``SEQKV_CODER_KERNELS=off`` (a diagnostic: the same integers either way).
"""

from __future__ import annotations

import functools
import os
from decimal import Decimal, localcontext
from operator import index
from typing import TYPE_CHECKING

import numpy as np

from seqkv_codecs.errors import CodecError, CorruptStreamError

if TYPE_CHECKING:
    import torch

MAX_PRECISION_BITS = 31
FRACTION_BITS = 10  # logit differences are quantised to 1/1024 of a bit
WEIGHT_BITS = 32  # the most likely symbol weighs exactly 2**32
LOG2E_SCALED = float.fromhex("0x1.71547652b82fep+10")  # float64(log2 e) * 2**10, exact
MAX_STEPS = (WEIGHT_BITS + 1) << FRACTION_BITS  # at 2**-33 of the top weight every weight is 0
_FRACTION_MASK = (1 << FRACTION_BITS) - 1
# From this many symbols row_jit looks a row's shares up in a table of every step's share
# (MAX_STEPS + 1 divisions a row) instead of dividing once per symbol: fewer divisions.
_SHARE_TABLE_FROM = MAX_STEPS + 1
_ROW_BLOCK = 4  # rows per numpy table (profiled: a 256-row table ran 2.5x slower per row)


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


@functools.cache
def step_weights() -> np.ndarray:
    """The weight of every step s in [0, MAX_STEPS]: ``T[s mod 1024] >> (s // 1024)``."""
    s = np.arange(MAX_STEPS + 1)
    weights = exp2_table()[s & _FRACTION_MASK] >> (s >> FRACTION_BITS)
    weights.setflags(write=False)
    return weights


@functools.cache
def _compiled():
    try:
        from seqkv_codecs.sequential import row_jit
    except ImportError:  # numba is missing: the numpy definition gives the same integers
        return None
    return row_jit


def _kernels():
    """row_jit, unless numba is missing or SEQKV_CODER_KERNELS=off."""
    if os.environ.get("SEQKV_CODER_KERNELS", "on").strip().lower() in ("off", "0", "no"):
        return None
    return _compiled()


def _kernel_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """(rows (M, V) float32 or float64 in C order, their maxima as float64), the types row_jit
    is compiled for (another float dtype converts exactly, as the definition converts every
    row to binary64); None if a row is one the definition refuses (NaN, +inf, all -inf: its
    maximum is not finite), which the numpy definition then reports."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.dtype not in (np.float32, np.float64):
        rows = rows.astype(np.float64)
    rows = np.ascontiguousarray(rows)
    tops = rows.max(axis=1).astype(np.float64) if rows.size else np.zeros(0)
    return (rows, tops) if np.isfinite(tops).all() else None


def _kernel_args(spare: int, floor: int, vocab: int) -> tuple:
    """What every row_jit call takes after its rows: the definition's constants and scratch."""
    steps = np.empty(vocab, dtype=np.int32)
    shares = np.empty(MAX_STEPS + 1, dtype=np.int64)
    return spare, floor, step_weights(), LOG2E_SCALED, _SHARE_TABLE_FROM, steps, shares


def _check_logits(x: np.ndarray) -> None:
    if x.ndim < 1 or x.dtype.kind != "f":
        raise CodecError(f"logits must be a float array with a vocabulary axis, not {x.dtype}")


def _spare_mass(vocab: int, precision_bits: int, floor: int) -> int:
    """Validate the arguments and return 2**P - V*floor, the mass shared out by probability."""
    if isinstance(precision_bits, bool) or not 1 <= precision_bits <= MAX_PRECISION_BITS:
        raise CodecError(f"precision_bits must be in 1..{MAX_PRECISION_BITS}, got {precision_bits}")
    if index(floor) < 1:
        raise CodecError(f"floor must be >= 1 so every symbol stays codable, got {floor}")
    if vocab < 1 or vocab * floor >= 1 << precision_bits:
        most = ((1 << precision_bits) - 1) // floor
        raise CodecError(
            f"a {vocab:,}-symbol vocabulary does not fit {precision_bits}-bit frequency tables "
            f"(at most {most:,} symbols with floor {floor}); raise precision_bits"
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
    _check_logits(x)
    spare = _spare_mass(x.shape[-1], precision_bits, floor)
    kernels = _kernels()
    ready = _kernel_rows(x) if kernels is not None else None
    if ready is None:
        return reference_frequencies(x, precision_bits, floor)
    rows, tops = ready
    out = np.empty(rows.shape, dtype=np.int64)
    kernels.frequencies(rows, tops, *_kernel_args(spare, floor, rows.shape[1]), out)
    return out.reshape(x.shape)


def reference_frequencies(
    logits: np.ndarray, precision_bits: int = 24, floor: int = 1
) -> np.ndarray:
    """:func:`frequencies_from_logits` as whole-row numpy operations: the definition
    (docs/format/RANGE_CODER.md §1) that the compiled kernels are checked against."""
    x = np.asarray(logits)
    _check_logits(x)
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


def intervals_from_logits(
    logits: np.ndarray, symbols: np.ndarray, precision_bits: int, floor: int = 1
) -> tuple[np.ndarray, np.ndarray]:
    """(cum_low, freq) of ``symbols[i]`` under the frequencies of row i of ``logits``
    (rows x V): what the encoder codes, without keeping any row's table."""
    x = np.asarray(logits)
    _check_logits(x)
    ids = np.asarray(symbols, dtype=np.int64).reshape(-1)
    rows = x.reshape(-1, x.shape[-1])
    if len(rows) != len(ids) or ((ids < 0) | (ids >= x.shape[-1])).any():
        raise CodecError(f"{len(ids)} symbols in [0, {x.shape[-1]}) for {len(rows)} rows")
    spare = _spare_mass(x.shape[-1], precision_bits, floor)
    low, freq = np.zeros(len(ids), np.int64), np.zeros(len(ids), np.int64)
    kernels = _kernels()
    ready = _kernel_rows(rows) if kernels is not None else None
    if ready is not None:
        rows, tops = ready
        row = np.empty(rows.shape[1], dtype=np.int64)
        kernels.intervals(
            rows, tops, ids, *_kernel_args(spare, floor, rows.shape[1]), row, low, freq
        )
        return low, freq
    columns = np.arange(rows.shape[1])
    for r in range(0, len(ids), _ROW_BLOCK):  # a few rows: their int64 tables stay in cache
        f = reference_frequencies(rows[r : r + _ROW_BLOCK], precision_bits, floor)
        nxt = ids[r : r + _ROW_BLOCK, None]
        low[r : r + len(f)] = np.where(columns < nxt, f, 0).sum(axis=1)
        freq[r : r + len(f)] = np.take_along_axis(f, nxt, axis=1)[:, 0]
    return low, freq


def find_symbol(row: np.ndarray, target: int) -> tuple[int, int]:
    """(s, cdf[s]) of the symbol whose interval ``[cdf[s], cdf[s + 1])`` holds ``target``
    under frequency ``row`` (the range decoder's search; a zero frequency is never found).
    ``CorruptStreamError`` when target is past the row's total."""
    f = np.asarray(row)
    kernels = _kernels()
    if kernels is not None:
        symbol, low = kernels.symbol_at(np.ascontiguousarray(f, dtype=np.int64), target)
        symbol, low = int(symbol), int(low)
    else:
        cdf = cumulative(f)
        symbol = int(np.searchsorted(cdf, target, side="right")) - 1
        symbol, low = (symbol, int(cdf[symbol])) if symbol < len(f) else (-1, 0)
    if symbol < 0:
        raise CorruptStreamError(f"target {target} lies past the frequency row's total")
    return symbol, low


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
