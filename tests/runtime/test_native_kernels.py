"""Each native kernel against the torch reference of the definition, on the values that break
naive code: the 2**53 bound of a product, zero, subnormal and clamped rows, exp's range ends."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from seqkv_cli.errors import SeqkvError
from seqkv_cli.runtime.portable import canary, elementary, exact, kernels

pytestmark = pytest.mark.skipif(not kernels.enabled(), reason="numba is not installed")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int64 if t.dtype == torch.float64 else torch.int32)


def _edge_rows() -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    a = torch.randn(40, 96, dtype=torch.float64, generator=g) * 4.0
    a[0] = 0.0
    a[1] = 5e-324  # subnormal
    a[2, :3] = torch.tensor([1e300, -1e300, 1.0])  # beyond the exponent clamp
    a[3] = a[3] * 1e-200
    a[4, :6] = torch.tensor([-745.5, 709.9, -744.0, 708.0, -0.0, 2.0**-1074])
    a[5, 0] = -math.inf
    return a


def test_exp_matches_the_reference_bit_for_bit():
    a = _edge_rows()
    native = elementary.exp(a)
    with kernels.reference():
        reference = elementary.exp(a)
    assert torch.equal(_bits(native), _bits(reference))
    assert float(native[5, 0]) == 0.0  # exp(-inf)
    assert torch.isnan(elementary.exp(torch.tensor([math.nan], dtype=torch.float64))).all()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("bits", [19, 21, 23, 26])
def test_quantize_and_split_match_the_reference(bits, dtype):
    a = _edge_rows().to(dtype)  # fp32: a weight, read by the kernel without an fp64 copy
    native = [*exact.quantize_rows(a, bits), *exact.split_rows(a, bits)]
    with kernels.reference():
        reference = [*exact.quantize_rows(a, bits), *exact.split_rows(a, bits)]
    for got, want in zip(native, reference, strict=True):
        assert torch.equal(_bits(got), _bits(want))


def _stored_f32(w: torch.Tensor):
    from seqkv_cli.runtime.checkpoint import StoredTensor

    return StoredTensor.of_tensor(w.float())


def test_row_peaks_are_the_references_in_every_chunk(monkeypatch):
    """A weight's row peaks, taken a chunk of rows at a time, are quantize_rows' exponents:
    rows of NaN, ±0, ±inf, subnormals and every binade, across chunk boundaries."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(301, 70, generator=g) * torch.logspace(-40, 38, 301)[:, None]
    w[0], w[1, 5], w[2], w[3] = math.nan, math.nan, -0.0, 0.0
    w[4, 3], w[5], w[6, 9], w[7] = -math.inf, -7.0, math.inf, 1e-44
    w[8, 1:] = -(2.0**100)  # the largest magnitude is the most negative value
    _, want = exact.quantize_rows(w, 0)
    for chunk in (70, 7 * 70, 10**6):  # a row, a few rows, the whole weight at a time
        monkeypatch.setattr(kernels, "PEAK_CHUNK", chunk)
        assert kernels.stored_peaks(_stored_f32(w)).tolist() == want[:, 0].tolist()


def test_products_are_exact_at_the_two_to_the_53_bound():
    """K terms of ±2**b · ±2**b with K · 2**(2b) = 2**53: every partial sum must stay exact."""
    k = 2048
    bits = exact.contraction_bits(k)
    top = 2**bits - 1  # a row whose peak is 2**bits - 1 quantizes to itself (e = 0)
    assert k * 4**bits <= 2**53
    w = torch.full((6, k), top, dtype=torch.float64)
    w[1] = -top
    w[2, ::2] = -top
    w[3] = torch.arange(k, dtype=torch.float64) % 7 - 3
    w[3, 0] = top
    w[4, :5] = torch.tensor([top, -top, 1.0, -1.0, 0.0])
    w[5] = top
    w[5, 1::2] = top - 1
    x = torch.stack([w[0], w[2], w[5], -w[5], w[3]]) + 1  # |x| up to 2**bits
    stored = _stored_f32(w)
    peaks = kernels.stored_peaks(stored)
    assert torch.equal(kernels.stored_tile(stored, 0, 6, peaks, bits), w)
    got = kernels.stored_products(x, stored, peaks, bits)
    want = [[sum(int(a) * int(b) for a, b in zip(xr, wr, strict=True)) for wr in w] for xr in x]
    assert got.tolist() == [[float(v) for v in row] for row in want]
    assert max(abs(v) for row in want for v in row) > 2**52


@pytest.mark.parametrize("form", [exact.PEAK1, exact.PEAK2, exact.L1])
def test_a_step_product_is_the_blas_product(form):
    from seqkv_cli.runtime.checkpoint import WeightStore
    from seqkv_cli.runtime.portable.weights import StoredRows, WeightCache

    g = torch.Generator().manual_seed(4)
    w = torch.randn(300, 576, generator=g)
    x = torch.randn(40, 576, generator=g) * 10
    x[1, 7] = 3e4  # an outlier channel: the L1 form spends no headroom on it
    bits = exact.right_bits(576, form)
    weight = StoredRows([_stored_f32(w)], WeightCache(torch.nn.Module(), WeightStore()))
    for rows in (1, 2, 3, 9, 40):  # steps (one row, several) and tiled BLAS products
        got = weight.product(x[:rows], bits, form)
        with kernels.reference():
            want = exact.fixed_product(x[:rows], bits, *exact.quantize_rows(w, bits), form)
        assert torch.equal(_bits(got), _bits(want))


@pytest.mark.parametrize("right", [20, 22, 23])
def test_quantize_l1_matches_the_reference(right):
    a = _edge_rows()
    a[6, 3] = 1e6  # one large channel in an ordinary row
    native = exact.quantize_l1(a, right)
    with kernels.reference():
        reference = exact.quantize_l1(a, right)
    for got, want in zip(native, reference, strict=True):
        assert torch.equal(_bits(got), _bits(want))


def test_l1_rows_keep_every_partial_sum_below_two_to_the_53():
    """The L1 form's promise, on the rows that stress it: flat rows (every element at the
    peak), one huge channel, and lengths from 2 to 2**14."""
    right = exact.L1_WEIGHT_BITS
    g = torch.Generator().manual_seed(8)
    for k in (2, 7, 576, 1536, 2**14):
        flat = torch.full((1, k), -3.0, dtype=torch.float64)
        spiky = torch.randn(1, k, dtype=torch.float64, generator=g)
        spiky[0, k // 2] = 1e5
        noisy = torch.rand(1, k, dtype=torch.float64, generator=g) * 2.0**-30 + 0.75
        for row in (flat, spiky, noisy):
            for native in (True, False):
                with contextlib.nullcontext() if native else kernels.reference():
                    xq, e = exact.quantize_l1(row, right)
                total = int(xq.abs().sum())  # integers: exact in Python
                assert total <= 2 ** (53 - right), (k, total)
                assert total > 2 ** (51 - right)  # and not far below: the bits are used
                # the scale is what it claims: |x - X·2^e| <= 2^(e-1) per element
                assert float((row - exact.scale(xq, e)).abs().max()) <= 2.0 ** (int(e) - 1)


def test_a_kernel_that_differs_is_refused_in_one_line(monkeypatch):
    assert canary.kernels_agree(("f32", "q4_k"))
    real = kernels.stored_step
    monkeypatch.setattr(kernels, "stored_step", lambda *a: real(*a) + 1.0)
    assert not canary.kernels_agree(("f32",))
    monkeypatch.setattr(canary, "_canary_ok", {})
    monkeypatch.setattr(canary, "_kinds_ok", set())
    monkeypatch.setattr(canary, "_steps_ok", set())
    canary.run_canary()  # a prefill's kernels agree; a step's are checked at their first use
    for _ in range(2):  # a refused kernel is never marked as checked
        with pytest.raises(SeqkvError, match="SEQKV_PORTABLE_KERNELS=reference") as err:
            canary.check_step("f32", exact.L1)
        assert "\n" not in str(err.value)


def test_a_prefill_kernel_that_differs_is_refused_before_first_use(monkeypatch):
    real = kernels.stored_tile
    monkeypatch.setattr(kernels, "stored_tile", lambda *a, **k: real(*a, **k) + 1.0)
    monkeypatch.setattr(canary, "_canary_ok", {})
    monkeypatch.setattr(canary, "_kinds_ok", set())
    with pytest.raises(SeqkvError, match="SEQKV_PORTABLE_KERNELS=reference"):
        canary.run_canary()


def test_a_few_rows_run_as_tiles_within_tiles_only():
    x = torch.randn(3, 64, dtype=torch.float64)
    assert kernels.native_product(x, exact.L1)
    with kernels.tiles_only():
        assert not kernels.native_product(x, exact.L1)
    assert kernels.native_product(x, exact.L1)


def test_the_reference_switch_turns_every_kernel_off(monkeypatch):
    monkeypatch.setenv(kernels.ENV, "reference")
    assert not kernels.enabled()
    assert not kernels.usable(torch.randn(4, 8))


def test_the_kernels_exp_has_the_definitions_length():
    from seqkv_cli.runtime.portable import jitted

    assert len(elementary.EXP_KERNEL[0]) == jitted.EXP_TERMS


def test_a_definition_runs_its_twin_only_where_the_switch_is_on_and_the_twin_takes_it(
    monkeypatch,
):
    from seqkv_cli.runtime import native

    @native.definition
    def double(x):
        return ("reference", x * 2)

    @native.twin(double)
    def _(x):
        return ("twin", x * 2) if x > 0 else NotImplemented

    assert double(3) == ("twin", 6) and double(-1) == ("reference", -2)
    with kernels.reference():
        assert double(3) == ("reference", 6)
    monkeypatch.setenv(kernels.ENV, "reference")
    assert double(3) == ("reference", 6)


def test_the_definitions_twins_are_registered_by_the_kernels_and_give_the_same_bits():
    from seqkv_cli.runtime import native

    twins = {fn.__name__ for fn in native._twins}
    assert {"quantize_rows", "quantize_l1", "split_rows", "fixed_matmul", "exp"} <= twins
    x = _edge_rows()[:, :64].float().nan_to_num(0.0, 1e30, -1e30)
    w = torch.randn(5, 64, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    for fn, args in (
        (exact.quantize_rows, (x, 21)),
        (exact.quantize_l1, (x, 22)),
        (exact.split_rows, (x.double(), 21)),
        (elementary.exp, (x.clamp(-80, 80),)),
        (exact.fixed_product, (x, 22, *exact.quantize_rows(w, 22), exact.PEAK2)),
        # v3's form: the twin declines, the reference's steps run their own twins
        (exact.fixed_product, (x, 22, *exact.quantize_rows(w, 22), exact.L1)),
    ):
        declines = fn is exact.fixed_product and args[-1] == exact.L1
        taken = native._twins[fn.reference](*args) is not NotImplemented
        assert taken != declines, fn.__name__
        native_out, reference_out = fn(*args), fn.reference(*args)
        with kernels.reference():
            whole_reference = fn(*args)  # every step inside the reference too
        for a, b, c in zip(
            *(
                o if isinstance(o, tuple) else (o,)
                for o in (native_out, reference_out, whole_reference)
            ),
            strict=True,
        ):
            assert _bits(a).equal(_bits(b)) and _bits(a).equal(_bits(c)), fn.__name__


@pytest.mark.parametrize("threads", [2, 3, 5])
def test_a_kernel_split_among_threads_gives_the_one_call_bits(threads):
    """`kernels._run` gives each thread a range of a kernel's tasks: the products, the
    quantizer, exp and the attention of a step give the same bits as one call does."""
    from seqkv_cli.runtime.checkpoint import KINDS, StoredTensor
    from seqkv_cli.runtime.checkpoint.formats import stored_array
    from seqkv_cli.runtime.portable.attention import PortableState, attend

    g = torch.Generator().manual_seed(11)
    x = torch.randn(3, 1536, generator=g)
    big = torch.randn(600, 1536, dtype=torch.float64, generator=g)
    raw = torch.randint(0, 256, (1000, KINDS["q8_0"].row_bytes(1536)), generator=g)
    stored = StoredTensor(
        KINDS["q8_0"], stored_array(KINDS["q8_0"], raw.byte().numpy()), (1000, 1536)
    )
    peaks = kernels.stored_peaks(stored)

    def run_all():
        state = PortableState(1, 2, 64, 600, (23, 23, 40), form=exact.L1)
        k = big[:, :128].float().reshape(600, 2, 64).transpose(0, 1).contiguous()
        state.write(0, k, k.flip(-1))
        state.length = 599
        return [
            kernels.stored_step(x[:1], 22, True, stored, peaks, 22),
            kernels.stored_step(x, 22, True, stored, peaks, 22),
            kernels.stored_tile(stored, 0, 1000, peaks, 22),
            *kernels.quantize_rows(big, 22, True),
            kernels.exp(big, elementary.EXP_KERNEL),
            attend(state, 0, x[0, :256].reshape(4, 1, 64).double(), 0.125, None, None),
        ]

    before = torch.get_num_threads()
    try:  # split first: a range left out would keep a fresh buffer's bytes, not old results
        torch.set_num_threads(threads)
        split = run_all()
        torch.set_num_threads(1)
        one = run_all()
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(one, split, strict=True))


def test_a_failure_in_one_threads_range_is_raised(monkeypatch):
    ranges = []

    def kernel(first, stop):
        ranges.append((first, stop))
        if first > 0:
            raise ValueError("boom")

    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    with pytest.raises(ValueError, match="boom"):
        kernels._run(kernel, 10, kernels.PARALLEL_WORK, step=True)
    assert sorted(ranges) == [(0, 2), (2, 5), (5, 7), (7, 10)]
    pool = kernels._pool(4)  # sized by torch's threads: a call of fewer tasks keeps it
    append = lambda first, stop: ranges.append((first, stop))  # noqa: E731
    kernels._run(append, 2, kernels.PARALLEL_WORK_PARKED)
    assert kernels._pool(4) is pool and ranges[-2:] in ([(0, 1), (1, 2)], [(1, 2), (0, 1)])
    kernels._run(append, 2, kernels.PARALLEL_WORK)  # a small kernel that is not a step: alone
    assert ranges[-1] == (0, 2)


def test_workers_take_jobs_spinning_parked_and_after_a_close():
    """Jobs reach a worker that spins (after a step's job) and one that parked (after any
    other, or an idle while); a closed set ends its threads; a second caller runs alone."""
    import threading

    from seqkv_cli.runtime.portable.workers import Workers

    workers = Workers(1)
    seen = []

    def job(tag, first, stop):
        seen.append((tag, first, stop))

    def jobs():
        for i in range(200):
            workers.run(job, (i,), [0, 1, 2], linger=i % 3 == 0)

    runner = threading.Thread(target=jobs, daemon=True)
    runner.start()
    runner.join(60)  # a lost wake-up would hang here
    assert not runner.is_alive()
    assert sorted(seen) == sorted((i, a, a + 1) for i in range(200) for a in (0, 1))
    with workers.busy:  # another caller holds them: this one runs its whole range alone
        workers.run(job, ("alone",), [0, 1, 2])
    assert seen[-1] == ("alone", 0, 2)
    threads = [w.thread for w in workers.workers]
    workers.close()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)
