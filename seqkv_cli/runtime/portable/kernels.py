"""Native kernels for the portable definition: the same bits as `exact`'s torch reference, faster.

The definition is `exact` (torch ops, each one correctly rounded IEEE operation); these numba
kernels compute the *same* values, so they change speed and never bits:

* **Integer products** (`int_products`). A fixed-point product's partial sums are integers
  below 2**53, so any order of adding them gives the same fp64 result — a vectorised loop
  over int32 weights is as exact as a BLAS call over fp64 ones, and reads half the bytes. A
  one-token step is bound by the weight bytes it reads (DESIGN.md §7), so steps run here and
  large products (prefill) keep the BLAS. Reassociation is the one fast-math flag allowed:
  it is what lets LLVM vectorise the sum, and on integer-valued sums it is exact.
* **Elementwise chains** (`exp`, `quantize_rows`, `split_rows`, `combine`): one pass per
  element instead of one torch kernel per operation. Compiled without fast-math, so every
  ``*`` and ``+`` is its own correctly rounded operation in the order `exact` writes it — no
  fused multiply-add, no reordering (LLVM contracts nothing it is not allowed to).

`kernel_check` compares every kernel with the torch reference on fixed inputs (the canary
runs it); a machine where one differs is refused in one line. ``SEQKV_PORTABLE_KERNELS=
reference`` turns the kernels off (the torch reference runs everything, slower, same bits).
numba is imported on first use only: `seqkv --help` never pays for it.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os

import numpy as np
import torch

ENV = "SEQKV_PORTABLE_KERNELS"
EXP_TERMS = 14  # the exp polynomial's length, a constant of the definition (exact._EXP_TERMS)
# Rows (activation limbs x sequences) up to which the int32 loop beats fp64 BLAS here: a step
# (2 limbs) and 8 sibling rows of one token at 1 limb; measured in bench/bench_numerics.py.
MAX_KERNEL_ROWS = 8


_forced_reference = False  # set by `reference()`: the kernel check computes both


def enabled() -> bool:
    """Whether the native kernels run (numba importable and not turned off by `ENV`)."""
    if _forced_reference or os.environ.get(ENV, "native") == "reference":
        return False
    return _numba() is not None


@contextlib.contextmanager
def reference():
    """Within it, `exact` runs its torch reference (to compare the kernels with it)."""
    global _forced_reference
    saved, _forced_reference = _forced_reference, True
    try:
        yield
    finally:
        _forced_reference = saved


def usable(*tensors: torch.Tensor) -> bool:
    """The kernels take CPU tensors only (a GPU keeps the torch reference)."""
    return all(t.device.type == "cpu" for t in tensors) and enabled()


@functools.cache
def _numba():
    try:
        import numba
    except ImportError:  # an optional speed-up: the reference gives the same bits
        return None
    return numba


# Work (multiply-adds or elements) from which a kernel runs on all threads: below it, waking
# a sleeping thread pool (OMP_WAIT_POLICY=PASSIVE, which the CLI sets) costs more than it saves.
PARALLEL_WORK = int(os.environ.get("PW", 1 << 18))
_threads_set = 0


def _variant(name: str, work: int):
    """The serial or the parallel build of kernel `name`, by the work one call does."""
    global _threads_set
    serial, parallel = _compiled()[name]
    n = min(torch.get_num_threads(), _numba().config.NUMBA_NUM_THREADS)
    if n <= 1 or work < PARALLEL_WORK:
        return serial
    if n != _threads_set:
        _numba().set_num_threads(n)
        _threads_set = n
    return parallel


@functools.cache
def _compiled() -> dict:
    """JIT-compile the kernels once per process (cached on disk by numba where writable),
    each as a serial and a parallel build (the same code: prange is range when serial)."""
    numba = _numba()
    njit, prange = numba.njit, numba.prange
    exact_flags = {"cache": True, "nogil": True}
    # Only reassociation: it vectorises an integer-valued sum, which it cannot change.
    sum_flags = {**exact_flags, "fastmath": {"reassoc"}}

    def products(x, hi, lo, out):  # x (M, K) f64 integers (M even), W = hi·256 + lo (N, K)
        m_rows, k_len = x.shape
        for n in prange(hi.shape[0]):
            for m in range(0, m_rows, 2):  # two rows per pass: the weight row stays in L1
                a0 = 0.0
                a1 = 0.0
                for k in range(k_len):
                    wk = hi[n, k] * 256.0 + lo[n, k]  # exact: |W| <= 2**23
                    a0 += x[m, k] * wk
                    a1 += x[m + 1, k] * wk
                out[m, n] = a0
                out[m + 1, n] = a1

    # 2**e for every normal exponent: a table lookup vectorises where a libm call would not.
    powers = np.ldexp(1.0, np.arange(-1022, 1024))

    @njit(inline="always", **exact_flags)
    def pow2(e):  # 2**e for integer e in [-1022, 1023]: exact, as exact.pow2
        return powers[e + 1022]

    @njit(inline="always", **exact_flags)
    def exp1(x0, coef, log2e, ln2_hi, ln2_lo, lo, hi):  # exact.exp of one value, step for step
        x = lo if x0 < lo else (hi if x0 > hi else x0)  # torch.clamp; NaN stays NaN
        k = np.rint(x * log2e)
        r = (x - k * ln2_hi) - k * ln2_lo
        acc = coef[0]  # coef: Horner order, highest first
        for j in range(1, EXP_TERMS):  # a constant count: unrolled, so the caller vectorises
            acc = acc * r + coef[j]
        ki = np.int64(k) if k == k else 0  # NaN: any in-range index, the result is NaN anyway
        half = ki >> 1  # floor division by 2, as exact.exp
        y = (acc * pow2(half)) * pow2(ki - half)
        return 0.0 if x0 == -math.inf else y

    def exp(a, out, coef, log2e, ln2_hi, ln2_lo, lo, hi):
        for i in prange(a.shape[0]):  # branch-free, so that it vectorises
            out[i] = exp1(a[i], coef, log2e, ln2_hi, ln2_lo, lo, hi)

    @njit(**exact_flags)
    def row_exponent(row, bits):  # exact.quantize_rows' e for one row
        peak = 0.0
        for v in row:
            a = abs(v)
            if a > peak or a != a:  # amax propagates NaN
                peak = a
        # frexp(0) = (0, 0); a non-finite peak: glibc's frexp gives exponent 0 as well
        e = 0 if peak == 0.0 or not np.isfinite(peak) else math.frexp(peak)[1]
        return min(max(e, -450), 450) - bits

    def quantize(a, bits, xq, ex):  # a (M, K) -> xq (M, K), ex (M,)
        for m in prange(a.shape[0]):
            e = row_exponent(a[m], bits)
            ex[m] = e
            s = pow2(-e)
            for k in range(a.shape[1]):
                xq[m, k] = np.rint(a[m, k] * s)

    def split(a, bits, out, ex):  # exact.split_rows of a (H, R, K): out (H, 2R, K), ex (H, R)
        heads, rows, k_len = a.shape
        for t in prange(heads * rows):
            h = t // rows
            r = t - h * rows
            e = row_exponent(a[h, r], bits)
            ex[h, r] = e
            down, back, rest = pow2(-e), pow2(e), pow2(bits - e)
            for k in range(k_len):
                q = np.rint(a[h, r, k] * down)
                out[h, r, k] = q
                out[h, rows + r, k] = np.rint((a[h, r, k] - q * back) * rest)

    def combine(s, erow, ecol, bits, out):  # scale(s1, e) + scale(s2, e - bits), e = erow+ecol
        heads, rows, n_cols = out.shape  # s (H, 2R, N): the two limbs' integer sums
        col = np.empty(n_cols)
        for n in range(n_cols):
            col[n] = pow2(ecol[n])
        for t in prange(heads * rows):
            h = t // rows
            r = t - h * rows
            # 2**e = 2**erow · 2**ecol exactly (every exponent here is normal, see
            # exact.quantize_rows' clamp), so the same multiplier as exact.scale's
            hi, lo = pow2(erow[h, r]), pow2(erow[h, r] - bits)
            for n in range(n_cols):
                out[h, r, n] = s[h, r, n] * (hi * col[n]) + s[h, rows + r, n] * (lo * col[n])

    @njit(**sum_flags)
    def integer_sum(v):  # integer-valued terms, sum below 2**53: exact in any order
        acc = 0.0
        for x in v:
            acc += x
        return acc

    def softmax_weights(s, ex, ek, ev, qpos, spec, coef, c1, c2, c3, c4, c5, w, ew, total):
        """attention.attend between its two products, per (head, query row): the scores from
        the q·k integer sums, the causal/window mask, exp, the rounded numerators and their
        sum, each key's value scale folded in, and the weights split as `split_rows`."""
        heads, rows = ew.shape  # w (H, limbs·R, n): the weights' integers, limb by limb
        n = w.shape[2]
        kbits, vbits, pbits, window, limbs, scaling = spec
        kb, vb, pb, wnd, two = int(kbits), int(vbits), int(pbits), int(window), limbs == 2.0
        for t in prange(heads * rows):
            h = t // rows
            r = t - h * rows
            buf = w[h, r]  # scores, then weights, then their first limb: in the output row
            for j in range(n):  # loops without a carried sum, so that they vectorise
                e = ex[h, r] + ek[h, j]
                sc = s[h, r, j] * pow2(e)
                if two:
                    sc = sc + s[h, rows + r, j] * pow2(e - kb)
                sc = sc * scaling
                hidden = j > qpos[r] or (wnd >= 0 and qpos[r] - j >= wnd)
                buf[j] = -math.inf if hidden else sc
            peak = -math.inf
            for j in range(n):
                if buf[j] > peak or buf[j] != buf[j]:  # amax propagates NaN
                    peak = buf[j]
            unit = pow2(pb)
            for j in range(n):
                buf[j] = np.rint(exp1(buf[j] - peak, coef, c1, c2, c3, c4, c5) * unit)
            total[h, r] = integer_sum(buf)
            for j in range(n):
                buf[j] = buf[j] * pow2(ev[h, j])
            e = row_exponent(buf, vb)
            ew[h, r] = e
            down, back, rest = pow2(-e), pow2(e), pow2(vb - e)
            for j in range(n):
                q = np.rint(buf[j] * down)
                if two:
                    w[h, rows + r, j] = np.rint((buf[j] - q * back) * rest)
                buf[j] = q

    @njit(inline="always", **sum_flags)
    def dot(a, b):  # integer-valued terms, every partial sum below 2**53: exact in any order
        acc = 0.0
        for i in range(a.shape[0]):
            acc += a[i] * b[i]
        return acc

    def attend_rows(q, kq, ek, vq, ev, n, qpos, spec, coef, c1, c2, c3, c4, c5, out):
        """attention.attend for a few query rows (a step), products included: per (head,
        row) the query's limbs, its integer sums with the first n keys, the softmax weights as
        `softmax_weights`, and their integer sums with the values, scaled and divided."""
        heads, rows, hd = out.shape
        kbits, vbits, pbits, window, limbs, scaling = spec
        kb, vb, pb, wnd, two = int(kbits), int(vbits), int(pbits), int(window), limbs == 2.0
        for t in prange(heads * rows):
            h = t // rows
            r = t - h * rows
            x1 = np.empty(hd)
            x2 = np.zeros(hd)
            e = row_exponent(q[h, r], kb)
            down, back, rest = pow2(-e), pow2(e), pow2(kb - e)
            for d in range(hd):
                x1[d] = np.rint(q[h, r, d] * down)
                x2[d] = np.rint((q[h, r, d] - x1[d] * back) * rest)
            buf = np.empty(n)
            for j in range(n):
                ej = e + ek[h, j]
                sc = dot(x1, kq[h, j]) * pow2(ej)
                if two:
                    sc = sc + dot(x2, kq[h, j]) * pow2(ej - kb)
                sc = sc * scaling
                hidden = j > qpos[r] or (wnd >= 0 and qpos[r] - j >= wnd)
                buf[j] = -math.inf if hidden else sc
            peak = -math.inf
            for j in range(n):
                if buf[j] > peak or buf[j] != buf[j]:  # amax propagates NaN
                    peak = buf[j]
            unit = pow2(pb)
            for j in range(n):
                buf[j] = np.rint(exp1(buf[j] - peak, coef, c1, c2, c3, c4, c5) * unit)
            total = integer_sum(buf)
            for j in range(n):
                buf[j] = buf[j] * pow2(ev[h, j])
            ew = row_exponent(buf, vb)
            down, back, rest = pow2(-ew), pow2(ew), pow2(vb - ew)
            acc1 = np.zeros(hd)
            acc2 = np.zeros(hd)
            for j in range(n):  # integer sums again: any order is exact
                w1 = np.rint(buf[j] * down)
                w2 = np.rint((buf[j] - w1 * back) * rest) if two else 0.0
                for d in range(hd):
                    acc1[d] += w1 * vq[h, j, d]
                    acc2[d] += w2 * vq[h, j, d]
            hi, lo = pow2(ew), pow2(ew - vb)
            for d in range(hd):
                v = acc1[d] * hi + acc2[d] * lo if two else acc1[d] * hi
                out[h, r, d] = v / total

    def both(fn, flags):
        return njit(**flags)(fn), njit(parallel=True, **flags)(fn)

    return {
        "products": both(products, sum_flags),
        "exp": both(exp, exact_flags),
        "quantize": both(quantize, exact_flags),
        "split": both(split, exact_flags),
        "combine": both(combine, exact_flags),
        "softmax_weights": both(softmax_weights, exact_flags),
        "attend_rows": both(attend_rows, exact_flags),
    }


def _np(t: torch.Tensor) -> np.ndarray:
    """A numpy view of t (a copy only where t is not contiguous): attribute checks, not
    dispatched torch ops, because a step makes thousands of these calls."""
    if t.requires_grad:
        t = t.detach()
    return (t if t.is_contiguous() else t.contiguous()).numpy()


def split_weights(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Integer weights |W| <= 2**23 as ``W = hi · 256 + lo``: hi int16 (int32 beyond 2**22),
    lo uint8. Three bytes a weight instead of fp64's eight: a step reads that many."""
    wi = w.to(torch.int32)
    hi = wi >> 8  # arithmetic shift: floor division, so lo = W - 256·hi is in [0, 255]
    fits = int(hi.abs().max()) < 2**15 if hi.numel() else True
    return (hi.to(torch.int16) if fits else hi).contiguous(), (wi & 255).to(torch.uint8)


def int_products(x: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """``x @ W.T`` for integer-valued fp64 x (M, K) and ``W = hi · 256 + lo`` (N, K)
    (`split_weights`): exact, fp64 (M, N)."""
    m = x.shape[0]
    xs = _np(x)
    if m % 2:  # the kernel takes rows in pairs: a zero row, dropped after
        xs = np.concatenate([xs, np.zeros((1, xs.shape[1]))])
    out = np.empty((xs.shape[0], hi.shape[0]), dtype=np.float64)
    _variant("products", out.size * xs.shape[1])(xs, _np(hi), _np(lo), out)
    return torch.from_numpy(out[:m])


def exp(a: torch.Tensor, constants: tuple) -> torch.Tensor:
    """`exact.exp` of an fp64 CPU tensor (same bits), any shape; ``constants`` are exact's
    (Horner coefficients highest first, log2 e, ln 2 in two parts, the clamp range)."""
    flat = _np(a).reshape(-1)
    out = np.empty_like(flat)
    _variant("exp", flat.size * 8)(flat, out, *constants)
    return torch.from_numpy(out).view(a.shape)


def _rows(a: torch.Tensor) -> np.ndarray:
    return _np(a).reshape(-1, a.shape[-1])


def quantize_rows(a: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`exact.quantize_rows` of an fp64 CPU tensor (same bits)."""
    rows = _rows(a)
    xq, ex = np.empty_like(rows), np.empty(rows.shape[0], dtype=np.int64)
    _variant("quantize", rows.size)(rows, bits, xq, ex)
    return torch.from_numpy(xq).view(a.shape), torch.from_numpy(ex).view(*a.shape[:-1], 1)


def split_stacked(a: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`exact.split_rows` of fp64 a (H, R, K) with both limbs in one array: (H, 2R, K), rows
    R..2R the remainders (what the product multiplies), and the exponents (H, R, 1)."""
    heads, rows, k = a.shape
    out = np.empty((heads, 2 * rows, k))
    ex = np.empty((heads, rows), dtype=np.int64)
    _variant("split", a.numel())(_np(a), bits, out, ex)
    return torch.from_numpy(out), torch.from_numpy(ex).view(heads, rows, 1)


def split_rows(a: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`exact.split_rows` of an fp64 CPU tensor (same bits)."""
    shape = a.shape
    both, ex = split_stacked(a.reshape(1, -1, shape[-1]), bits)
    m = both.shape[1] // 2
    return both[0, :m].view(shape), both[0, m:].view(shape), ex.view(*shape[:-1], 1)


def combine(s: torch.Tensor, erow: torch.Tensor, ecol: torch.Tensor, bits: int) -> torch.Tensor:
    """``scale(s1, e) + scale(s2, e - bits)`` with e = erow + ecol, for the two limbs' sums
    s (H, 2R, N) (`split_stacked` order), erow (H, R, 1) and ecol (N, 1): fp64 (H, R, N)."""
    heads, two_rows, n = s.shape
    out = np.empty((heads, two_rows // 2, n))
    _variant("combine", out.size)(
        _np(s), _np(erow).reshape(heads, -1), _np(ecol).reshape(-1), bits, out
    )
    return torch.from_numpy(out)


def softmax_weights(
    s: torch.Tensor,
    ex: torch.Tensor,
    ek: torch.Tensor,
    ev: torch.Tensor,
    qpos: torch.Tensor,
    bits: tuple[int, int, int],
    window: int | None,
    limbs: int,
    scaling: float,
    constants: tuple,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """attention.attend's steps between its two products, fused (same bits).

    s (heads, limbs·R, n): the integer sums of the R query rows' limbs with the keys;
    ex (heads, R, 1), ek and ev (heads, n, 1): row exponents of the queries, keys and values;
    qpos (R,): each query row's position; bits: the state's (key, value, probability) bits.
    Returns the value weights' integers (heads, limbs·R, n; `split_stacked` order), their row
    exponents (heads, R, 1) and each row's numerator total (heads, R, 1).
    """
    heads, _, n = s.shape
    rows = ex.shape[1]
    w = np.empty((heads, limbs * rows, n))
    ew = np.empty((heads, rows), dtype=np.int64)
    total = np.empty((heads, rows))
    spec = (*map(float, bits), -1.0 if window is None else float(window), float(limbs), scaling)
    _variant("softmax_weights", heads * rows * n * 40)(
        _np(s),
        _np(ex).reshape(heads, rows),
        _np(ek).reshape(heads, n),
        _np(ev).reshape(heads, n),
        _np(qpos),
        spec,
        *constants,
        w,
        ew,
        total,
    )
    as_t = torch.from_numpy
    return as_t(w), as_t(ew).view(heads, rows, 1), as_t(total).view(heads, rows, 1)


def attend_rows(
    q: torch.Tensor,
    state,
    layer: int,
    n: int,
    qpos: torch.Tensor,
    window: int | None,
    scaling: float,
    constants: tuple,
) -> torch.Tensor:
    """attention.attend's block for few query rows, both products included (same bits).

    q (heads, R, hd) the query rows (fp64); the keys and values are the first ``n``
    positions of `state`'s ``layer`` (read in place: no copy of the cache per step); qpos (R,)
    each row's position. Returns fp64 (heads, R, hd).
    """
    heads, rows, hd = q.shape
    out = np.empty((heads, rows, hd))
    spec = (
        *map(float, state.bits),
        -1.0 if window is None else float(window),
        float(state.limbs),
        scaling,
    )
    cap = state.capacity
    _variant("attend_rows", heads * rows * n * hd * 4)(
        _np(q),
        _np(state.kq[layer]),
        _np(state.ek[layer]).reshape(heads, cap),
        _np(state.vq[layer]),
        _np(state.ev[layer]).reshape(heads, cap),
        n,
        _np(qpos),
        spec,
        *constants,
        out,
    )
    return torch.from_numpy(out)
