"""The portable numeric definition: results that are the same bits on every IEEE machine.

Only operations that IEEE 754 rounds correctly everywhere are trusted: + - * / and √, exact
conversions, comparisons, max/min, rounding to an integer, and integer arithmetic. On top of
them:

* **Products of fixed-point integers.** A matrix product quantizes each contraction vector
  (a row of the left operand, a column of the right one) to integers with a power-of-two
  scale, ``x = X · 2^e``, small enough that every partial sum stays below 2^53. Then an fp64
  product of the integers is exact in any summation order, on any BLAS, thread count or GPU,
  and scaling back by powers of two is exact too: one rounding to the output dtype remains.
  The left operand (activations, queries, softmax weights) takes one of three *forms*, one per
  version of the definition: v1 one integer per element, the row's scale set by its peak
  (``b`` bits each side, ``2b + log2 K <= 53``); v2 two such integers,
  ``x ≈ (X1 + X2 · 2^-b) · 2^e`` (two exact products, one correctly rounded fp64 add); v3 one
  integer with the row's scale set by its **L1 norm**: ``Σ|X| <= 2^(53 - w)`` against weights
  of ``w`` bits bounds every partial sum directly, so a row with a few large channels keeps
  the bits that ``K · peak`` spent on headroom — v2's accuracy, or better, in one product.
* **Transcendentals from polynomials** and **reductions in a fixed tree**: `elementary`.

Every function returns the dtype of its (first) input unless said otherwise; fp64 is only the
working precision. This module is the definition as torch ops and nothing else: a function
marked `definition` may be computed by a native twin (`kernels`, the same bits), chosen in one
place (`runtime.native`). Any change here (or in `elementary`) changes coded bytes: it makes a new
numeric path (``NUMERIC_PATH_V4``, a new entry in ``FORMS``), never a change of an old one.
"""

from __future__ import annotations

import torch

from seqkv_cli.runtime.native import definition

NUMERIC_PATH_V1 = "portable-fx53-v1"
NUMERIC_PATH_V2 = "portable-fx53-v2"
NUMERIC_PATH_V3 = "portable-fx53-v3"
# The form of every product's left operand, per version of the definition (module docstring):
# one or two integers per element scaled by the row's peak, or one scaled by its L1 norm.
PEAK1, PEAK2, L1 = 1, 2, 3
FORMS = {NUMERIC_PATH_V1: PEAK1, NUMERIC_PATH_V2: PEAK2, NUMERIC_PATH_V3: L1}
MANTISSA = 53  # fp64 holds every integer of magnitude <= 2**53 exactly
# v3's right operands: weights of a linear, and the keys and values of attention, quantized
# per row to these bits whatever the contraction length (measured: docs/NUMERICS.md, v3).
L1_WEIGHT_BITS = 22
L1_KV_BITS = 23
# Integers of at most this many bits (|X| <= 2**24) are exact in fp32.
FP32_INTEGER_BITS = 24
L1_UNIT = 30  # an element's share of its row's L1 bound, in 2**-30 of the row's peak


def limbs(form: int) -> int:
    """Integers per element of a left operand in `form` (rows a product multiplies)."""
    return 2 if form == PEAK2 else 1


def contraction_bits(length: int) -> int:
    """Bits per operand of a fixed-point product over ``length`` terms (both operands alike)."""
    return (MANTISSA - max(1, length - 1).bit_length()) // 2


def right_bits(length: int, form: int) -> int:
    """Bits of a product's right operand (weights) over ``length`` terms, in `form`."""
    return L1_WEIGHT_BITS if form == L1 else contraction_bits(length)


def f64(x: torch.Tensor) -> torch.Tensor:
    """x as fp64 (exact), without a copy when it already is."""
    return x if x.dtype == torch.float64 else x.to(torch.float64)


def pow2(e: torch.Tensor) -> torch.Tensor:
    """2**e as fp64 for integer ``e`` in [-1022, 1023], built from its bits (exact)."""
    return ((e.to(torch.int64) + 1023) << 52).view(torch.float64)


def scale(x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """x · 2**e for e in [-1022, 1023]: exact unless the result leaves the normal range."""
    return x * pow2(e)


@definition
def quantize_rows(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x ≈ X · 2**e`` per last-axis row: X integer-valued fp64 with |X| <= 2**bits.

    The scale depends on that row alone, so a row quantizes the same in any batch.
    """
    a = f64(x)
    _, exponent = torch.frexp(a.abs().amax(dim=-1, keepdim=True))
    # Clamped so that any two scales multiply to a normal power of two (|e1 + e2| < 1022);
    # rows beyond 2**±450 never occur (fp32 ends at 2**128).
    e = exponent.to(torch.int64).clamp(-450, 450) - bits
    return torch.round(scale(a, -e)), e


@definition
def quantize_l1(x: torch.Tensor, right: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x ≈ X · 2**e`` per last-axis row with ``Σ|X| <= 2**(53 - right)`` (v3's left form):
    against a right operand of ``right`` bits every partial sum of a product stays below 2**53.

    The bound is computed exactly: with ``E`` the row's peak exponent (`quantize_rows`' clamp),
    each element's units ``ceil(|x| · 2**(30 - E)) <= 2**30`` are integers whose sum U is exact
    in any order, ``Σ|x| <= U · 2**(E - 30)``, and ``e = E + L - 30 - (52 - right)`` for
    ``U < 2**L`` leaves one bit for the rounding of K elements (K <= 2**(53 - right)).
    A zero or non-finite row takes E = L = 0.
    """
    a = f64(x)
    peak = a.abs().amax(dim=-1, keepdim=True)
    _, exponent = torch.frexp(peak)  # 0 for a zero, infinite or NaN peak
    e_peak = exponent.to(torch.int64).clamp(-450, 450)
    units = torch.ceil(scale(a.abs(), L1_UNIT - e_peak)).sum(dim=-1, keepdim=True)
    _, length = torch.frexp(units)
    e = e_peak + length.to(torch.int64) - L1_UNIT - (MANTISSA - 1 - right)
    return torch.round(scale(a, -e)), e


def quantize_left(x: torch.Tensor, bits: int, form: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A one-integer left operand against a right one of ``bits``: v1's or v3's form."""
    return quantize_l1(x, bits) if form == L1 else quantize_rows(x, bits)


@definition
def fixed_matmul(
    xq: torch.Tensor, ex: torch.Tensor, wq: torch.Tensor, ew: torch.Tensor
) -> torch.Tensor:
    """Exact fp64 ``(X · 2^ex) @ (W · 2^ew)ᵀ`` from quantized rows xq (.., M, K), wq (.., N, K)."""
    s = torch.matmul(xq, wq.transpose(-1, -2))
    return scale(s, ex + ew.transpose(-1, -2))  # one exact power of two (see quantize_rows)


@definition
def split_rows(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x ≈ (X1 + X2 · 2**-bits) · 2**e`` per last-axis row: X1 as `quantize_rows`, X2 its
    rounded remainder (|X2| <= 2**(bits-1)), so a row keeps twice the bits.

    The remainder ``x - X1 · 2**e`` is exact: both terms are multiples of x's own ulp (or X1
    is 0 or ±1 and x within a factor 2 of 2**e), and it is at most 2**(e-1).
    """
    a = f64(x)
    x1, e = quantize_rows(a, bits)
    x2 = torch.round(scale(a - scale(x1, e), bits - e))
    return x1, x2, e


@definition
def fixed_product(
    x: torch.Tensor, bits: int, wq: torch.Tensor, ew: torch.Tensor, form: int = PEAK1
) -> torch.Tensor:
    """Exact-per-limb fp64 ``x @ (W · 2^ew)ᵀ``: x (.., M, K) quantized here in `form`
    against wq (.., N, K) of ``bits``.

    With two limbs both integers of a row go through one product (rows M..2M are the
    remainders), and their scaled results meet in one correctly rounded fp64 add.
    """
    if form != PEAK2:
        xq, ex = quantize_left(x, bits, form)
        return fixed_matmul(xq, ex, wq, ew)
    x1, x2, ex = split_rows(x, bits)
    m = x1.shape[-2]
    s = torch.matmul(torch.cat([x1, x2], dim=-2), wq.transpose(-1, -2))
    e = ex + ew.transpose(-1, -2)  # >= -969 (quantize_rows' clamp): 2**(e - bits) is normal
    return scale(s[..., :m, :], e) + scale(s[..., m:, :], e - bits)


def matmul(a: torch.Tensor, b: torch.Tensor, form: int = PEAK1) -> torch.Tensor:
    """``a @ b`` (batched like torch.matmul) in the portable definition, fp64 result."""
    k = a.shape[-1]
    if k == 1:  # an outer product: one correctly rounded multiplication per element
        return a.to(torch.float64) * b.to(torch.float64)
    bits = right_bits(k, form)
    wq, ew = quantize_rows(b.transpose(-1, -2), bits)
    return fixed_product(a, bits, wq, ew, form)
