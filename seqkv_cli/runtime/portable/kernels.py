"""Native kernels for the portable definition: the same bits as `exact`'s torch reference, faster.

The definition is `exact` (torch ops, each one correctly rounded IEEE operation); these numba
kernels compute the *same* values, so they change speed and never bits:

* **Integer products** (`stored_step`, `stored_tile`). A fixed-point product's partial sums
  are integers below 2**53, so any order of adding them gives the same fp64 result — a
  vectorised loop over a weight row's integers is as exact as a BLAS call over fp64 ones.
  A one-token step is bound by the weight bytes it reads, so a step's few rows run here,
  reading each weight at its stored width and making its integers in registers
  (`jitted_weights`); larger products (prefill) get fp64 tiles for the BLAS. Reassociation
  is the one fast-math flag allowed: it is what lets LLVM vectorise the sum, and on
  integer-valued sums it is exact.
* **Elementwise chains** (`exp`, `quantize_rows`, `split_rows`, `combine`): one pass per
  element instead of one torch kernel per operation. Compiled without fast-math, so every
  ``*`` and ``+`` is its own correctly rounded operation in the order `exact` writes it — no
  fused multiply-add, no reordering (LLVM contracts nothing it is not allowed to).

The definition's own functions reach their kernels through twins registered at the end of
this module (`runtime.native.definition`): `exact` and `elementary` never name a kernel.
`canary.kernels_agree` compares the kernels with the torch reference on fixed inputs; a
machine where one differs is refused in one line. ``SEQKV_PORTABLE_KERNELS=
reference`` turns the kernels off (the torch reference runs everything, slower, same bits).
numba is imported on first use only: `seqkv --help` never pays for it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading

import numpy as np
import torch

from seqkv_cli.runtime.native import ENV, enabled, reference, twin  # noqa: F401 (the switch)
from seqkv_cli.runtime.portable import elementary, exact

# Rows (activation limbs x sequences) up to which a product over stored weights runs in the
# native kernel (each weight row's integers made once, then every row's sum) rather than
# through fp64 BLAS tiles: a step, guessed tokens, trie rows in lockstep (docs/BENCHMARKS.md).
MAX_KERNEL_ROWS = 32


def usable(*tensors: torch.Tensor) -> bool:
    """The kernels take CPU tensors only (a GPU keeps the torch reference)."""
    return all(t.device.type == "cpu" for t in tensors) and enabled()


_tiles_only = False


@contextlib.contextmanager
def tiles_only():
    """Within it, products and attention of few rows run as a prefill's do (tiles, the
    fused softmax between two products: the same bits): a probe of a few tokens then
    compiles no step kernel that a capture would not need."""
    global _tiles_only
    saved, _tiles_only = _tiles_only, True
    try:
        yield
    finally:
        _tiles_only = saved


def steps_allowed() -> bool:
    return not _tiles_only


def native_product(x: torch.Tensor, form: int) -> bool:
    """Whether a native step kernel should run ``x @ W.T`` (few rows on a CPU: a step)."""
    few = x[..., 0].numel() * exact.limbs(form) <= MAX_KERNEL_ROWS
    return few and usable(x) and steps_allowed()


def kernel_input(x: torch.Tensor) -> torch.Tensor:
    """x as the quantizing kernels read it: fp32 or fp64 as it is (every fp32 value is exact
    in their fp64 arithmetic, so no copy of a weight is made), anything else as fp64."""
    return x if x.dtype in (torch.float32, torch.float64) else exact.f64(x)


# Elements of a weight decoded at a time for its row peaks: they are taken once, during a
# step, so the chunk is small beside what a step holds (the store's hashing chunk is larger).
PEAK_CHUNK = 1 << 20

# Work (multiply-adds, or elements weighted by what each costs) from which a kernel runs on all
# threads: below it, handing a range to a worker costs more than it saves. A step's kernels
# find the workers spinning (a hand-off in microseconds); other kernels find them parked, and
# waking one costs much more (`workers`; measured in docs/BENCHMARKS_LOG.md).
PARALLEL_WORK = 1 << 18
PARALLEL_WORK_PARKED = 1 << 21
TILE_ELEMENT_WORK = 4  # a tile element is a block decoded and rounded: a few operations
_workers: tuple[int, object] | None = None  # (torch's thread count, its `workers.Workers`)
_workers_lock = threading.Lock()


def _pool(threads: int):
    """The workers beside the caller for ``threads`` threads, made again when torch's thread
    count changes (the old ones end once a caller still on them is done)."""
    global _workers
    with _workers_lock:
        if _workers is None or _workers[0] != threads:
            from seqkv_cli.runtime.portable.workers import Workers

            old, _workers = _workers, (threads, Workers(threads - 1))
            if old is not None:
                old[1].close()
        return _workers[1]


def _forget_workers() -> None:  # a forked child has the objects but none of their threads
    global _workers, _workers_lock
    _workers, _workers_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_workers)


def _run(kernel, tasks: int, work: int, *args, step: bool = False) -> None:
    """``kernel(*args, first, stop)`` over its ``tasks`` independent tasks: in one call, or,
    where the work pays for it, in torch's number of threads, one contiguous range of tasks
    each (the kernels release the GIL). Each task writes its own outputs, so the bits do not
    depend on the split. A kernel of a `step` keeps the workers spinning for the next one."""
    threads = torch.get_num_threads()
    n = min(threads, tasks)
    if n <= 1 or work < (PARALLEL_WORK if step else PARALLEL_WORK_PARKED):
        kernel(*args, 0, tasks)
        return
    _pool(threads).run(kernel, args, [tasks * i // n for i in range(n + 1)], linger=step)


def _weight_tasks(rows: int) -> int:
    """The tasks of a product kernel over ``rows`` weight rows (`jitted_weights`' unit)."""
    return -(-rows // _jitted_weights().ROWS_PER_TASK)


@functools.cache
def _jitted_weights():
    """`jitted_weights`, imported on first use (it imports numba), then held."""
    from seqkv_cli.runtime.portable import jitted_weights

    return jitted_weights


@functools.cache
def _compiled() -> dict:
    """The kernels (`jitted`, `jitted_attention`), imported once per process: numba compiles
    each on its first call, or loads it from its disk cache (the package's __pycache__, where
    writable)."""
    from seqkv_cli.runtime.portable import jitted, jitted_attention

    return {**jitted.KERNELS, **jitted_attention.KERNELS}


def _np(t: torch.Tensor) -> np.ndarray:
    """A numpy view of t (a copy only where t is not contiguous): attribute checks, not
    dispatched torch ops, because a step makes thousands of these calls."""
    if t.requires_grad:
        t = t.detach()
    return (t if t.is_contiguous() else t.contiguous()).numpy()


def _stored(kind: str, name: str):
    """Kernel ``name`` for weights held as ``kind``."""
    return _compiled_kind(kind)[name]


@functools.cache
def _compiled_kind(kind: str) -> dict:
    return _jitted_weights().compile_kind(kind)


def stored_peaks(stored) -> np.ndarray:
    """Each row's clamped peak exponent (`exact.quantize_rows`) of a `StoredTensor`, int64
    (N,): its fp32 rows a bounded chunk at a time (the decoder the fingerprint runs), their
    peaks taken as the reference takes them (a row holding a NaN has a NaN peak)."""
    exponents = []
    for rows in stored.fp32_chunks(PEAK_CHUNK):
        low, high = torch.aminmax(rows, dim=-1)  # max |x| without a copy of |x|; NaN stays
        _, e = torch.frexp(torch.maximum(high, -low).to(torch.float64))
        exponents.append(e.to(torch.int64).clamp(-450, 450))
    return torch.cat(exponents).numpy() if exponents else np.empty(0, dtype=np.int64)


def stored_runs(stored) -> np.ndarray:
    """Each row's run bounds (`jitted_weights.run_bounds`), fp64 (N, 2), from its scales alone:
    what lets a step sum the row's whole runs in limbs with no check a run. Kinds a step
    does not sum that way get bounds that are never met."""
    out = np.full((stored.shape[0], 2), np.inf)
    bounds = _compiled_kind(stored.kind.name).get("run_bounds")
    if bounds is not None:
        work = stored.shape[0] * stored.shape[1] // 16  # scales only: a run's few bytes
        tasks = _weight_tasks(stored.shape[0])
        _run(bounds, tasks, work, stored.raw, stored.shape[1], out)
    return out


def stored_tile(stored, start: int, stop: int, peaks: np.ndarray, bits: int) -> torch.Tensor:
    """The definition's integers (`exact.quantize_rows` at ``bits``) of rows start..stop of a
    `StoredTensor`, fp64 (stop - start, K): what a BLAS product multiplies."""
    out = np.empty((stop - start, stored.shape[1]))
    tile = _stored(stored.kind.name, "tile")
    work = out.size * TILE_ELEMENT_WORK
    _run(tile, _weight_tasks(stop - start), work, stored.raw, start, peaks, bits, out)
    return torch.from_numpy(out)


def stored_step(
    x: torch.Tensor,
    right: int,
    l1: bool,
    stored,
    peaks: np.ndarray,
    bits: int,
    runs: np.ndarray | None = None,
) -> torch.Tensor:
    """`exact.fixed_product` of a one-integer form for few rows, in one native call: x (M, K)
    quantized against the integers of a `StoredTensor` (N, K) at ``bits``, each made where it
    is multiplied: fp64 (M, N), the same bits. x may be a numpy array (fp32 or fp64); the
    result is then one too. ``runs``: the weight's `stored_runs`, made here when not given
    (a caller that steps holds them, as it holds the peaks)."""
    xs = x if isinstance(x, np.ndarray) else _np(x)
    out = np.empty((xs.shape[0], stored.shape[0]), dtype=np.float64)
    work = out.size * xs.shape[1]
    step = _stored(stored.kind.name, "step")
    tasks = _weight_tasks(out.shape[1])
    runs = stored_runs(stored) if runs is None else runs
    _run(step, tasks, work, xs, right, l1, stored.raw, peaks, runs, bits, out, step=True)
    return out if isinstance(x, np.ndarray) else torch.from_numpy(out)


def stored_products(x: torch.Tensor, stored, peaks: np.ndarray, bits: int) -> torch.Tensor:
    """``x @ W.T`` for integer-valued fp64 x (M, K) and the integers W of a `StoredTensor`
    at ``bits``: the exact integer sums, fp64 (M, N)."""
    xs = _np(x)
    out = np.empty((xs.shape[0], stored.shape[0]), dtype=np.float64)
    products = _stored(stored.kind.name, "products")
    work = out.size * xs.shape[1]
    tasks = _weight_tasks(out.shape[1])
    _run(products, tasks, work, xs, stored.raw, peaks, bits, out, step=True)
    return torch.from_numpy(out)


def exp(a: torch.Tensor, constants: tuple) -> torch.Tensor:
    """`elementary.exp` of an fp64 CPU tensor (same bits), any shape; ``constants`` are elementary's
    (Horner coefficients highest first, log2 e, ln 2 in two parts, the clamp range)."""
    flat = _np(a).reshape(-1)
    out = np.empty_like(flat)
    _run(_compiled()["exp"], flat.size, flat.size * 8, flat, out, *constants)
    return torch.from_numpy(out).view(a.shape)


def rms_norm(h: np.ndarray, weight: np.ndarray, eps: np.float32) -> np.ndarray:
    """fused.FusedDecoder._rms_norm of fp32 rows h (M, K) with an fp32 weight (K,): fp32."""
    out = np.empty_like(h)
    _compiled()["rms_norm"](h, weight, eps, out, 0, h.shape[0])
    return out


def silu_product(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """elementary.silu(gate) * up of fp32 rows (M, N): fp32."""
    out = np.empty_like(gate)
    _compiled()["silu_product"](gate, up, out, *elementary.EXP_KERNEL, 0, gate.shape[0])
    return out


def _rows(a: torch.Tensor) -> np.ndarray:
    return _np(a).reshape(-1, a.shape[-1])


def quantize_rows(
    a: torch.Tensor, bits: int, l1: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """`exact.quantize_rows` (or, with `l1`, `exact.quantize_l1` against a right operand of
    ``bits``) of an fp64 or fp32 CPU tensor (same bits: every fp32 value is exact in fp64,
    and the kernel's arithmetic is fp64): fp64 integers."""
    rows = _rows(a)
    xq, ex = np.empty(rows.shape), np.empty(rows.shape[0], dtype=np.int64)
    _run(_compiled()["quantize"], rows.shape[0], rows.size, rows, bits, l1, xq, ex)
    return torch.from_numpy(xq).view(a.shape), torch.from_numpy(ex).view(*a.shape[:-1], 1)


def split_stacked(a: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`exact.split_rows` of fp64 a (H, R, K) with both limbs in one array: (H, 2R, K), rows
    R..2R the remainders (what the product multiplies), and the exponents (H, R, 1)."""
    heads, rows, k = a.shape
    out = np.empty((heads, 2 * rows, k))
    ex = np.empty((heads, rows), dtype=np.int64)
    _run(_compiled()["split"], heads * rows, a.numel(), _np(a), bits, out, ex)
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
    erow, ecol = _np(erow).reshape(heads, -1), _np(ecol).reshape(-1)
    _run(_compiled()["combine"], heads * (two_rows // 2), out.size, _np(s), erow, ecol, bits, out)
    return torch.from_numpy(out)


def scale_product(s: torch.Tensor, erow: torch.Tensor, ecol: torch.Tensor) -> torch.Tensor:
    """``exact.scale(s, erow + ecolᵀ)`` for a product's integer sums s (M, N), erow (M, 1)
    and ecol (N, 1), in one pass (same bits), **in place**: s is the caller's own product
    (a fresh output the size of a prefill's logits costs page faults; rewriting it does not)."""
    if not s.is_contiguous():
        s = s.contiguous()
    out = _np(s)
    erow, ecol = _np(erow).reshape(-1), _np(ecol).reshape(-1)
    _run(_compiled()["scale_product"], out.shape[0], out.size, out, erow, ecol, out)
    return s


def softmax_weights(
    s: torch.Tensor,
    ex: torch.Tensor,
    ek: torch.Tensor,
    ev: torch.Tensor,
    qpos: torch.Tensor,
    bits: tuple[int, int, int],
    window: int | None,
    form: int,
    scaling: float,
    constants: tuple,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """attention.attend's steps between its two products, fused (same bits).

    s (heads, limbs·R, n): the integer sums of the R query rows' limbs (``form``, as
    `exact.FORMS`) with the keys;
    ex (heads, R, 1), ek and ev (heads, n, 1): row exponents of the queries, keys and values;
    qpos (R,): each query row's position; bits: the state's (key, value, probability) bits.
    Returns the value weights' integers (heads, limbs·R, n; `split_stacked` order), their row
    exponents (heads, R, 1) and each row's numerator total (heads, R, 1).
    """
    heads, _, n = s.shape
    rows = ex.shape[1]
    w = np.empty((heads, (2 if form == 2 else 1) * rows, n))  # exact.limbs(form)
    ew = np.empty((heads, rows), dtype=np.int64)
    total = np.empty((heads, rows))
    spec = (*map(float, bits), -1.0 if window is None else float(window), float(form), scaling)
    _run(
        _compiled()["softmax_weights"],
        heads * rows,
        heads * rows * n * 40,
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


def step_attention(q, k, v, cos, sin, state, layer: int, window, scaling: float) -> np.ndarray:
    """A step's attention for one sequence and layer, from its projections to its output, in
    two native calls: the rotary and the cache write (`PortableState.write`'s bits), then
    `attend_rows`' kernel over the positions so far. q (heads, hd), k and v (kv_heads, hd),
    cos and sin (hd,): fp32 numpy rows. Returns fp64 (heads, hd)."""
    kvh, hd = k.shape
    groups = q.shape[0] // kvh
    p0 = state.length
    keys, values, kq, ek, vq, ev = (a[layer] for a in state.arrays())
    qg = np.empty((kvh, groups, hd))
    _compiled()["rotate_store"](
        q, k, v, cos, sin, keys, values, kq, ek, vq, ev, p0, state.key_bits, state.value_bits, qg
    )
    qpos = np.full(groups, p0, dtype=np.int64)
    out = _attend(qg, state, layer, p0 + 1, qpos, window, scaling, elementary.EXP_KERNEL)
    return out.reshape(kvh * groups, hd)


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
    out = _attend(_np(q), state, layer, n, _np(qpos), window, scaling, constants)
    return torch.from_numpy(out)


def _attend(q, state, layer, n, qpos, window, scaling, constants) -> np.ndarray:
    """`attend_rows` on numpy query rows (heads, R, hd) and positions (R,): fp64 (heads, R, hd)."""
    heads, rows, hd = q.shape
    out = np.empty((heads, rows, hd))
    spec = (
        *map(float, state.bits),
        -1.0 if window is None else float(window),
        float(state.form),
        scaling,
    )
    _, _, kq, ek, vq, ev = (a[layer] for a in state.arrays())
    cap = state.capacity
    _run(
        _compiled()["attend_rows"],
        heads * rows,
        heads * rows * n * hd * 2,  # a multiply-add a key and dimension in each product
        q,
        kq,
        ek.reshape(heads, cap),
        vq,
        ev.reshape(heads, cap),
        n,
        qpos,
        spec,
        *constants,
        out,
        step=True,
    )
    return out


# -- the twins of the definition's functions (`runtime.native.definition`) ------------------
# Each takes what its kernel can (CPU tensors, the shapes it is written for) and returns
# NotImplemented otherwise, so the reference runs.


@twin(exact.quantize_rows)
def _quantize_rows(x: torch.Tensor, bits: int):
    return quantize_rows(kernel_input(x), bits) if usable(x) else NotImplemented


@twin(exact.quantize_l1)
def _quantize_l1(x: torch.Tensor, right: int):
    return quantize_rows(kernel_input(x), right, l1=True) if usable(x) else NotImplemented


@twin(exact.split_rows)
def _split_rows(x: torch.Tensor, bits: int):
    return split_rows(exact.f64(x), bits) if usable(x) else NotImplemented


@twin(exact.fixed_matmul)
def _fixed_matmul(xq, ex, wq, ew):
    """A linear's product: the scaling in one pass over the BLAS result."""
    if wq.dim() != 2 or not usable(xq):
        return NotImplemented
    n = wq.shape[0]
    s = torch.matmul(xq, wq.transpose(-1, -2))
    return scale_product(s.reshape(-1, n), ex.reshape(-1, 1), ew).view(*xq.shape[:-1], n)


@twin(exact.fixed_product)
def _fixed_product(x, bits, wq, ew, form=exact.PEAK1):
    """v2's two limbs in one product without the torch temporaries (other forms: the
    reference, whose steps have twins of their own)."""
    if form != exact.PEAK2 or wq.dim() != 2 or not usable(x):
        return NotImplemented
    k = x.shape[-1]
    both, ex = split_stacked(exact.f64(x).reshape(1, -1, k), bits)
    out = combine(torch.matmul(both, wq.transpose(-1, -2)), ex, ew, bits)
    return out.view(*x.shape[:-1], wq.shape[0])


@twin(elementary.exp)
def _exp(x: torch.Tensor):
    return exp(exact.f64(x), elementary.EXP_KERNEL).to(x.dtype) if usable(x) else NotImplemented
