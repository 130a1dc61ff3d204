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
* **Transcendentals from polynomials.** ``exp``, ``log``, ``sin``, ``cos`` and what is built
  on them are range-reduced and evaluated with separate fp64 ``mul``/``add`` kernels (no fused
  multiply-add can change a bit), so they do not depend on a math library.
* **Reductions in a fixed tree.** Sums over a dimension add halves pairwise in fp64, in an
  order fixed by the shape alone.

Every function returns the dtype of its (first) input unless said otherwise; fp64 is only the
working precision. Any change here changes coded bytes: bump ``NUMERIC_PATH``.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from seqkv_cli.runtime.portable import kernels

NUMERIC_PATH = "portable-fx53-v1"
NUMERIC_PATH_V2 = "portable-fx53-v2"
NUMERIC_PATH_V3 = "portable-fx53-v3"
# The form of every product's left operand, per version of the definition (module docstring):
# one or two integers per element scaled by the row's peak, or one scaled by its L1 norm.
PEAK1, PEAK2, L1 = 1, 2, 3
FORMS = {NUMERIC_PATH: PEAK1, NUMERIC_PATH_V2: PEAK2, NUMERIC_PATH_V3: L1}
MANTISSA = 53  # fp64 holds every integer of magnitude <= 2**53 exactly
# v3's right operands: weights of a linear, and the keys and values of attention, quantized
# per row to these bits whatever the contraction length (measured: docs/NUMERICS.md, v3).
L1_WEIGHT_BITS = 22
L1_KV_BITS = 23
L1_UNIT = 30  # an element's share of its row's L1 bound, in 2**-30 of the row's peak


def limbs(form: int) -> int:
    """Integers per element of a left operand in `form` (rows a product multiplies)."""
    return 2 if form == PEAK2 else 1


_LOG2E = float.fromhex("0x1.71547652b82fep+0")
_LN2_HI = float.fromhex("0x1.62e42fee00000p-1")  # 32 significant bits: k * hi is exact
_LN2_LO = float.fromhex("0x1.a39ef35793c76p-33")
_TWO_OVER_PI = float.fromhex("0x1.45f306dc9c883p-1")
_PIO2 = (  # pi/2 in three parts of 33 bits (Cody-Waite): k * part is exact for |k| < 2**20
    float.fromhex("0x1.921fb54400000p+0"),
    float.fromhex("0x1.0b4611a600000p-34"),
    float.fromhex("0x1.3198a2e037073p-69"),
)
_EXP_TERMS = 14  # Taylor terms of exp on |r| <= ln2/2: truncation < 2**-60 (and jitted's)
_TRIG_TERMS = 11  # Taylor terms of sin/cos on |r| <= pi/4
_EXP_MIN, _EXP_MAX = -745.0, 709.0


def contraction_bits(length: int) -> int:
    """Bits per operand of a fixed-point product over ``length`` terms (both operands alike)."""
    return (MANTISSA - max(1, length - 1).bit_length()) // 2


def right_bits(length: int, form: int) -> int:
    """Bits of a product's right operand (weights) over ``length`` terms, in `form`."""
    return L1_WEIGHT_BITS if form == L1 else contraction_bits(length)


def f64(x: torch.Tensor) -> torch.Tensor:
    """x as fp64 (exact), without a copy when it already is."""
    return x if x.dtype == torch.float64 else x.to(torch.float64)


def kernel_input(x: torch.Tensor) -> torch.Tensor:
    """x as the quantizing kernels read it: fp32 or fp64 as it is (every fp32 value is exact
    in their fp64 arithmetic, so no copy of a weight is made), anything else as fp64."""
    return x if x.dtype in (torch.float32, torch.float64) else f64(x)


def pow2(e: torch.Tensor) -> torch.Tensor:
    """2**e as fp64 for integer ``e`` in [-1022, 1023], built from its bits (exact)."""
    return ((e.to(torch.int64) + 1023) << 52).view(torch.float64)


def scale(x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """x · 2**e for e in [-1022, 1023]: exact unless the result leaves the normal range."""
    return x * pow2(e)


def quantize_rows(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x ≈ X · 2**e`` per last-axis row: X integer-valued fp64 with |X| <= 2**bits.

    The scale depends on that row alone, so a row quantizes the same in any batch.
    """
    if kernels.usable(x):
        return kernels.quantize_rows(kernel_input(x), bits)
    a = f64(x)
    _, exponent = torch.frexp(a.abs().amax(dim=-1, keepdim=True))
    # Clamped so that any two scales multiply to a normal power of two (|e1 + e2| < 1022);
    # rows beyond 2**±450 never occur (fp32 ends at 2**128).
    e = exponent.to(torch.int64).clamp(-450, 450) - bits
    return torch.round(scale(a, -e)), e


def quantize_l1(x: torch.Tensor, right: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x ≈ X · 2**e`` per last-axis row with ``Σ|X| <= 2**(53 - right)`` (v3's left form):
    against a right operand of ``right`` bits every partial sum of a product stays below 2**53.

    The bound is computed exactly: with ``E`` the row's peak exponent (`quantize_rows`' clamp),
    each element's units ``ceil(|x| · 2**(30 - E)) <= 2**30`` are integers whose sum U is exact
    in any order, ``Σ|x| <= U · 2**(E - 30)``, and ``e = E + L - 30 - (52 - right)`` for
    ``U < 2**L`` leaves one bit for the rounding of K elements (K <= 2**(53 - right)).
    A zero or non-finite row takes E = L = 0.
    """
    if kernels.usable(x):
        return kernels.quantize_rows(kernel_input(x), right, l1=True)
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


def fixed_matmul(
    xq: torch.Tensor, ex: torch.Tensor, wq: torch.Tensor, ew: torch.Tensor
) -> torch.Tensor:
    """Exact fp64 ``(X · 2^ex) @ (W · 2^ew)ᵀ`` from quantized rows xq (.., M, K), wq (.., N, K)."""
    s = torch.matmul(xq, wq.transpose(-1, -2))
    if wq.dim() == 2 and kernels.usable(s):  # a linear's product: the scaling in one pass
        n = wq.shape[0]
        out = kernels.scale_product(s.reshape(-1, n), ex.reshape(-1, 1), ew)
        return out.view(*xq.shape[:-1], n)
    return scale(s, ex + ew.transpose(-1, -2))  # one exact power of two (see quantize_rows)


def split_rows(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x ≈ (X1 + X2 · 2**-bits) · 2**e`` per last-axis row: X1 as `quantize_rows`, X2 its
    rounded remainder (|X2| <= 2**(bits-1)), so a row keeps twice the bits.

    The remainder ``x - X1 · 2**e`` is exact: both terms are multiples of x's own ulp (or X1
    is 0 or ±1 and x within a factor 2 of 2**e), and it is at most 2**(e-1).
    """
    a = f64(x)
    if kernels.usable(a):
        return kernels.split_rows(a, bits)
    x1, e = quantize_rows(a, bits)
    x2 = torch.round(scale(a - scale(x1, e), bits - e))
    return x1, x2, e


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
    if kernels.usable(x) and wq.dim() == 2:  # the same steps, without the torch temporaries
        k = x.shape[-1]
        both, ex = kernels.split_stacked(f64(x).reshape(1, -1, k), bits)
        out = kernels.combine(torch.matmul(both, wq.transpose(-1, -2)), ex, ew, bits)
        return out.view(*x.shape[:-1], wq.shape[0])
    x1, x2, ex = split_rows(x, bits)
    m = x1.shape[-2]
    s = torch.matmul(torch.cat([x1, x2], dim=-2), wq.transpose(-1, -2))
    e = ex + ew.transpose(-1, -2)  # >= -969 (quantize_rows' clamp): 2**(e - bits) is normal
    return scale(s[..., :m, :], e) + scale(s[..., m:, :], e - bits)


def native_product(x: torch.Tensor, form: int) -> bool:
    """Whether `kernel_product` should run ``x @ W.T`` (few rows on a CPU: a step)."""
    return x[..., 0].numel() * limbs(form) <= kernels.MAX_KERNEL_ROWS and kernels.usable(x)


def kernel_product(
    x: torch.Tensor,
    bits: int,
    w: tuple[torch.Tensor, torch.Tensor],
    ew: torch.Tensor,
    form: int = PEAK1,
) -> torch.Tensor:
    """`fixed_product` with the weight integers as `kernels.split_weights` (hi, lo) (N, K): the
    same bits, read at three bytes a weight by the native loop (kernels.int_products)."""
    k = x.shape[-1]
    rows = x.reshape(-1, k)
    if form != PEAK2:
        out = kernels.step_product(kernel_input(rows), bits, form == L1, *w, ew)
    else:
        both, ex = kernels.split_stacked(f64(rows)[None], bits)
        out = kernels.combine(kernels.int_products(both[0], *w)[None], ex, ew, bits)
    return out.view(*x.shape[:-1], w[0].shape[0])


def matmul(a: torch.Tensor, b: torch.Tensor, form: int = PEAK1) -> torch.Tensor:
    """``a @ b`` (batched like torch.matmul) in the portable definition, fp64 result."""
    k = a.shape[-1]
    if k == 1:  # an outer product: one correctly rounded multiplication per element
        return a.to(torch.float64) * b.to(torch.float64)
    bits = right_bits(k, form)
    wq, ew = quantize_rows(b.transpose(-1, -2), bits)
    return fixed_product(a, bits, wq, ew, form)


def tree_sum(x: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
    """Sum over ``dim`` in fp64, adding halves pairwise in an order fixed by the length."""
    a = f64(x).movedim(dim, -1)
    n = a.shape[-1]
    if n == 0:
        out = a.new_zeros(a.shape[:-1])
    else:
        width = 1 << (n - 1).bit_length()
        if width != n:
            a = torch.nn.functional.pad(a, (0, width - n))
        while a.shape[-1] > 1:
            half = a.shape[-1] // 2
            a = a[..., :half] + a[..., half:]
        out = a[..., 0]
    return out.unsqueeze(dim) if keepdim else out


def _poly(r: torch.Tensor, coefficients: list[float]) -> torch.Tensor:
    """Horner's rule with separate multiply and add kernels (never fused)."""
    acc = torch.full_like(r, coefficients[-1])
    for c in reversed(coefficients[:-1]):
        acc = torch.add(torch.mul(acc, r), c)
    return acc


_EXP_COEF = [1.0 / math.factorial(n) for n in range(_EXP_TERMS)]
EXP_KERNEL = (  # the same constants for the native kernel (Horner order: highest first)
    np.array(_EXP_COEF[::-1], dtype=np.float64),
    _LOG2E,
    _LN2_HI,
    _LN2_LO,
    _EXP_MIN,
    _EXP_MAX,
)


def exp(x: torch.Tensor) -> torch.Tensor:
    """e**x: x = k·ln2 + r, Taylor polynomial of e**r, times 2**k."""
    a = f64(x)
    if kernels.usable(a):
        return kernels.exp(a, EXP_KERNEL).to(x.dtype)
    neg_inf = a == -math.inf
    a = a.clamp(_EXP_MIN, _EXP_MAX)
    k = torch.round(a * _LOG2E)
    r = (a - k * _LN2_HI) - k * _LN2_LO
    k = k.to(torch.int64)
    half = torch.div(k, 2, rounding_mode="floor")  # k reaches -1075: two normal factors
    out = scale(scale(_poly(r, _EXP_COEF), half), k - half)
    return torch.where(neg_inf, 0.0, out).to(x.dtype)


def log(x: torch.Tensor) -> torch.Tensor:
    """Natural log: x = m·2**k with m in [√½, √2), log m = 2·atanh((m-1)/(m+1)) as a series."""
    a = f64(x)
    m, k = torch.frexp(a)
    small = m < math.sqrt(0.5)
    m = torch.where(small, m * 2.0, m)
    k = (k - small.to(k.dtype)).to(torch.float64)
    s = (m - 1.0) / (m + 1.0)
    s2 = s * s
    series = _poly(s2, [2.0 / (2 * n + 1) for n in range(14)])
    out = (s * series + k * _LN2_LO) + k * _LN2_HI
    out = torch.where(a == 0, -math.inf, out)
    out = torch.where((a < 0) | torch.isnan(a), math.nan, out)
    return torch.where(a == math.inf, math.inf, out).to(x.dtype)


_SIN_COEF = [(-1.0) ** n / math.factorial(2 * n + 1) for n in range(_TRIG_TERMS)]
_COS_COEF = [(-1.0) ** n / math.factorial(2 * n) for n in range(_TRIG_TERMS)]


def _reduce_quadrant(x: torch.Tensor):
    a = f64(x)
    k = torch.round(a * _TWO_OVER_PI)
    r = ((a - k * _PIO2[0]) - k * _PIO2[1]) - k * _PIO2[2]
    r2 = r * r
    s = r * _poly(r2, _SIN_COEF)
    c = _poly(r2, _COS_COEF)
    return torch.remainder(k.to(torch.int64), 4), s, c


def sin(x: torch.Tensor) -> torch.Tensor:
    q, s, c = _reduce_quadrant(x)
    out = torch.where(q == 0, s, torch.where(q == 1, c, torch.where(q == 2, -s, -c)))
    return out.to(x.dtype)


def cos(x: torch.Tensor) -> torch.Tensor:
    q, s, c = _reduce_quadrant(x)
    out = torch.where(q == 0, c, torch.where(q == 1, -s, torch.where(q == 2, -c, s)))
    return out.to(x.dtype)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    a = f64(x)
    return (1.0 / (1.0 + exp(-a))).to(x.dtype)


def silu(x: torch.Tensor) -> torch.Tensor:
    a = f64(x)
    return (a / (1.0 + exp(-a))).to(x.dtype)


def tanh(x: torch.Tensor) -> torch.Tensor:
    """tanh from exp; a short odd series near 0, where 1 - 2/(e^2x + 1) would cancel."""
    a = f64(x)
    big = 1.0 - 2.0 / (exp(2.0 * a.abs()) + 1.0)
    big = torch.where(a < 0, -big, big)
    a2 = a * a
    series = a * _poly(a2, [1.0, -1.0 / 3, 2.0 / 15, -17.0 / 315, 62.0 / 2835])
    return torch.where(a.abs() < 2.0**-6, series, big).to(x.dtype)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))), the "gelu_pytorch_tanh" of Gemma/Phi."""
    a = f64(x)
    inner = math.sqrt(2.0 / math.pi) * (a + 0.044715 * (a * a * a))
    return (0.5 * a * (1.0 + tanh(inner))).to(x.dtype)


def rsqrt(x: torch.Tensor) -> torch.Tensor:
    a = f64(x)
    return (1.0 / torch.sqrt(a)).to(x.dtype)


def pow_(base: torch.Tensor | float, exponent: torch.Tensor | float, dtype: torch.dtype):
    """base ** exponent: exact for the exponents models use (2, 0.5, -0.5, 1), else exp(y·log x)."""
    if isinstance(exponent, int | float) and isinstance(base, torch.Tensor):
        a = base.to(torch.float64)
        exact = {1: lambda: a, 2: lambda: a * a, 0.5: lambda: torch.sqrt(a), -0.5: lambda: rsqrt(a)}
        if exponent in exact:
            return exact[exponent]().to(dtype)
        if exponent == int(exponent) and 0 <= exponent <= 8:
            out = torch.ones_like(a)
            for _ in range(int(exponent)):
                out = out * a
            return out.to(dtype)
    b = torch.as_tensor(base, dtype=torch.float64)
    y = torch.as_tensor(exponent, dtype=torch.float64)
    device = base.device if isinstance(base, torch.Tensor) else exponent.device
    return exp(y.to(device) * log(b.to(device))).to(dtype)


def softmax(x: torch.Tensor, dim: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    a = f64(x)
    e = exp(a - a.amax(dim=dim, keepdim=True))
    return (e / tree_sum(e, dim, keepdim=True)).to(dtype or x.dtype)


def log_softmax(x: torch.Tensor, dim: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    a = f64(x)
    shifted = a - a.amax(dim=dim, keepdim=True)
    return (shifted - log(tree_sum(exp(shifted), dim, keepdim=True))).to(dtype or x.dtype)
