"""The portable definition's elementary functions and reductions: exp, log, sin, cos and
what is built on them (tanh, sigmoid, SiLU, erf, both GELUs, powers, softmax), and sums in a
fixed tree.

Transcendentals are range-reduced and evaluated as polynomials with separate fp64
``mul``/``add`` kernels (no fused multiply-add can change a bit), so they do not depend on a
math library; sums over a dimension add halves pairwise in fp64, in an order fixed by the
shape alone. Every function returns the dtype of its (first) input unless said otherwise.
The fixed-point products are `exact`'s; any change here changes coded bytes too.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from seqkv_cli.runtime.native import definition
from seqkv_cli.runtime.portable import exact

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


def tree_sum(x: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
    """Sum over ``dim`` in fp64, adding halves pairwise in an order fixed by the length."""
    a = exact.f64(x).movedim(dim, -1)
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


@definition
def exp(x: torch.Tensor) -> torch.Tensor:
    """e**x: x = k·ln2 + r, Taylor polynomial of e**r, times 2**k."""
    a = exact.f64(x)
    neg_inf = a == -math.inf
    a = a.clamp(_EXP_MIN, _EXP_MAX)
    k = torch.round(a * _LOG2E)
    r = (a - k * _LN2_HI) - k * _LN2_LO
    k = k.to(torch.int64)
    half = torch.div(k, 2, rounding_mode="floor")  # k reaches -1075: two normal factors
    out = exact.scale(exact.scale(_poly(r, _EXP_COEF), half), k - half)
    return torch.where(neg_inf, 0.0, out).to(x.dtype)


def log(x: torch.Tensor) -> torch.Tensor:
    """Natural log: x = m·2**k with m in [√½, √2), log m = 2·atanh((m-1)/(m+1)) as a series."""
    a = exact.f64(x)
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
    a = exact.f64(x)
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
    a = exact.f64(x)
    return (1.0 / (1.0 + exp(-a))).to(x.dtype)


def silu(x: torch.Tensor) -> torch.Tensor:
    a = exact.f64(x)
    return (a / (1.0 + exp(-a))).to(x.dtype)


def tanh(x: torch.Tensor) -> torch.Tensor:
    """tanh from exp; a short odd series near 0, where 1 - 2/(e^2x + 1) would cancel."""
    a = exact.f64(x)
    big = 1.0 - 2.0 / (exp(2.0 * a.abs()) + 1.0)
    big = torch.where(a < 0, -big, big)
    a2 = a * a
    series = a * _poly(a2, [1.0, -1.0 / 3, 2.0 / 15, -17.0 / 315, 62.0 / 2835])
    return torch.where(a.abs() < 2.0**-6, series, big).to(x.dtype)


_ERF_SPLIT = 2.5  # below: erf's Taylor series; from here: erfc's continued fraction
_ERF_TERMS = 44  # on |x| < 2.5 the last term is below 2**-56 of the sum
_ERFC_DEPTH = 40  # levels of the continued fraction from the bottom, a fixed count
_ERF_COEF = [(-1.0) ** n / (math.factorial(n) * (2 * n + 1)) for n in range(_ERF_TERMS)]
_TWO_OVER_SQRT_PI = 2.0 / math.sqrt(math.pi)


def erf(x: torch.Tensor) -> torch.Tensor:
    """erf: 2/√π·Σ (-1)ⁿ x²ⁿ⁺¹/(n!(2n+1)) near 0; further out 1 - erfc, erfc by its continued
    fraction e^(-x²)/√π · 1/(x + ½/(x + 1/(x + 1.5/(x + …)))) evaluated from a fixed depth.
    Both are computed and the range picks one: the same operations on every element."""
    a = exact.f64(x)
    near = _TWO_OVER_SQRT_PI * (a * _poly(a * a, _ERF_COEF))
    m = a.abs()
    tail = torch.zeros_like(m)
    for k in range(_ERFC_DEPTH, 0, -1):
        tail = (k / 2.0) / (m + tail)
    erfc = exp(-(m * m)) / math.sqrt(math.pi) / (m + tail)
    far = torch.where(a < 0, erfc - 1.0, 1.0 - erfc)
    return torch.where(m < _ERF_SPLIT, near, far).to(x.dtype)


def gelu_erf(x: torch.Tensor) -> torch.Tensor:
    """0.5·x·(1 + erf(x/√2)): the exact GELU ("gelu") of GPT-NeoX, Falcon, BERT-style MLPs."""
    a = exact.f64(x)
    return (0.5 * a * (1.0 + erf(a * math.sqrt(0.5)))).to(x.dtype)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))), the "gelu_pytorch_tanh" of Gemma/Phi."""
    a = exact.f64(x)
    inner = math.sqrt(2.0 / math.pi) * (a + 0.044715 * (a * a * a))
    return (0.5 * a * (1.0 + tanh(inner))).to(x.dtype)


def rsqrt(x: torch.Tensor) -> torch.Tensor:
    a = exact.f64(x)
    return (1.0 / torch.sqrt(a)).to(x.dtype)


def power(base: torch.Tensor | float, exponent: torch.Tensor | float, dtype: torch.dtype):
    """``base ** exponent`` (torch.pow) in the definition: exact for the exponents models use
    (2, 0.5, -0.5, 1, small integers), else exp(y·log x); the result in ``dtype``."""
    if isinstance(exponent, int | float) and isinstance(base, torch.Tensor):
        a = base.to(torch.float64)
        closed = {
            1: lambda: a,
            2: lambda: a * a,
            0.5: lambda: torch.sqrt(a),
            -0.5: lambda: rsqrt(a),
        }
        if exponent in closed:
            return closed[exponent]().to(dtype)
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
    a = exact.f64(x)
    e = exp(a - a.amax(dim=dim, keepdim=True))
    return (e / tree_sum(e, dim, keepdim=True)).to(dtype or x.dtype)


def log_softmax(x: torch.Tensor, dim: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    a = exact.f64(x)
    shifted = a - a.amax(dim=dim, keepdim=True)
    return (shifted - log(tree_sum(exp(shifted), dim, keepdim=True))).to(dtype or x.dtype)
