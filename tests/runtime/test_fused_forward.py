"""The native kernels and the fused decoder give the reference's bits, for every family.

The reference is the model's own transformers code under `PortableMode` with every primitive
in torch (``SEQKV_PORTABLE_KERNELS=reference``); the default run uses the numba kernels for
products, transcendentals and attention, and the fused decoder for llama/mistral/qwen2/qwen3.
Both are compared on one prefill, chunks, token-by-token steps and two sequences stepped as
rows: logits and every K/V tensor, bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import FAMILIES, tiny_family_model
from seqkv_cli.runtime.portable import exact, fused, kernels
from seqkv_cli.runtime.portable.model import PortableLM


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.view(torch.uint8))


def _run_all_ways(lm: PortableLM, ids: torch.Tensor) -> list[torch.Tensor]:
    n = len(ids)
    whole_state = lm.new_state(n)
    whole = lm.forward(whole_state, ids)
    steps_state = lm.new_state(n)
    steps = torch.cat([lm.forward(steps_state, ids[i : i + 1]) for i in range(n)])
    chunk_state = lm.new_state(n)
    chunks = torch.cat([lm.forward(chunk_state, ids[a:b]) for a, b in ((0, 9), (9, 10), (10, n))])
    row_a, row_b = lm.new_state(n), lm.new_state(n)
    lm.forward(row_b, ids[:5])
    rows = torch.stack(
        [lm.forward_rows([row_a, row_b], [int(ids[i]), int(ids[i + 5])]) for i in range(n - 5)]
    )
    out = [whole, steps, chunks, rows]
    for state in (whole_state, steps_state, chunk_state, row_a, row_b):
        out += [state.keys[:, :, : state.length], state.values[:, :, : state.length]]
    return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_native_run_gives_the_reference_bits(family, monkeypatch):
    ids = torch.randint(3, 300, (24,), generator=torch.Generator().manual_seed(2))
    model = tiny_family_model(family, max_position_embeddings=64)
    native_lm = PortableLM(model)
    assert (native_lm.fused is not None) == (family in fused.FAMILIES)
    native = _run_all_ways(native_lm, ids)
    monkeypatch.setenv(kernels.ENV, "reference")
    reference_lm = PortableLM(model)
    assert reference_lm.fused is None and not kernels.enabled()
    reference = _run_all_ways(reference_lm, ids)
    for got, want in zip(native, reference, strict=True):
        assert _same(got, want)


def test_fused_decoder_is_probed_and_dropped_where_it_differs(monkeypatch):
    """A fused forward that differs from this transformers' modeling code is not used."""
    model = tiny_family_model("llama")

    def off_by_one_ulp(self, x, module):
        out = original(x, module)
        return torch.nextafter(out, torch.full_like(out, float("inf")))

    original = fused.FusedDecoder._rms_norm
    monkeypatch.setattr(fused.FusedDecoder, "_rms_norm", staticmethod(off_by_one_ulp.__get__(0)))
    with pytest.warns(UserWarning, match="does not match this transformers version"):
        lm = PortableLM(model)
    assert lm.fused is None


@pytest.mark.parametrize("path", [exact.NUMERIC_PATH_V1, exact.NUMERIC_PATH_V2])
def test_older_paths_run_the_kernels_too(path, monkeypatch):
    """v1 and v2 files decode through the same kernels and fused decoder, to the reference's
    bits (their forms take other branches of every kernel)."""
    ids = torch.randint(3, 300, (24,), generator=torch.Generator().manual_seed(5))
    model = tiny_family_model("llama", max_position_embeddings=64)
    lm = PortableLM(model, path)
    assert lm.fused is not None and lm.form == exact.FORMS[path]
    native = _run_all_ways(lm, ids)
    monkeypatch.setenv(kernels.ENV, "reference")
    reference = _run_all_ways(PortableLM(model, path), ids)
    for got, want in zip(native, reference, strict=True):
        assert _same(got, want)


@pytest.mark.parametrize("path", sorted(exact.FORMS))
def test_a_step_runs_natively_once_it_agrees(path, recwarn):
    """One token a row takes the native step (v2's two limbs: the torch path), without a
    warning, once the check before the first step found it equal to the fused torch path."""
    lm = PortableLM(tiny_family_model("qwen3", max_position_embeddings=64), path)
    state = lm.new_state(8)
    lm.forward(state, torch.tensor([5, 6, 7]))
    assert lm.fused.native_step is None  # a prefill does not check it
    lm.forward(state, torch.tensor([8]))
    assert lm.fused.native_step is (path != exact.NUMERIC_PATH_V2)
    assert not [w for w in recwarn if "native" in str(w.message)]


def test_a_native_step_that_differs_is_dropped_with_one_warning(monkeypatch):
    """The check before the first step compares the native step with the fused torch path: a
    kernel one ulp off leaves the torch path in use, and the bits stay the reference's."""
    ids = torch.randint(3, 300, (24,), generator=torch.Generator().manual_seed(3))
    model = tiny_family_model("llama", max_position_embeddings=64)
    real = kernels.rms_norm

    def off_by_one_ulp(*args):
        out = real(*args)
        return np.nextafter(out, np.float32(np.inf))

    monkeypatch.setattr(kernels, "rms_norm", off_by_one_ulp)
    lm = PortableLM(model)
    with pytest.warns(UserWarning, match="native llama step does not match"):
        got = _run_all_ways(lm, ids)
    assert lm.fused.native_step is False
    monkeypatch.setenv(kernels.ENV, "reference")
    for a, b in zip(got, _run_all_ways(PortableLM(model), ids), strict=True):
        assert _same(a, b)


def test_a_models_first_step_checks_its_step_kernels(monkeypatch):
    """The step kernels are checked at their first use by a model (not at load): a step
    kernel that gives other bits is refused in one line before the step's product runs."""
    from seqkv_cli.errors import SeqkvError
    from seqkv_cli.runtime.portable import canary

    lm = PortableLM(tiny_family_model("llama", max_position_embeddings=64))
    real = kernels.stored_step
    monkeypatch.setattr(kernels, "stored_step", lambda *a: real(*a) + 1.0)
    monkeypatch.setattr(canary, "_steps_ok", set())
    for _ in range(2):  # a refused kernel stays unchecked: refused again
        with pytest.raises(SeqkvError, match="SEQKV_PORTABLE_KERNELS=reference") as err:
            lm.forward(lm.new_state(8), torch.tensor([8]))
        assert "\n" not in str(err.value)
    monkeypatch.setattr(kernels, "stored_step", real)
    assert lm.forward(lm.new_state(8), torch.tensor([8])).isfinite().all()


@pytest.mark.parametrize("kernels_env", ["native", "reference"])
@pytest.mark.parametrize("family", ["llama", "gpt_neox"])
def test_integers_held_in_fp32_give_the_bits_of_fp64(family, kernels_env, monkeypatch):
    """The attention state holds its key and value integers in fp32 (half the bytes): every
    product, step kernel and reference alike, sees the values an fp64 copy holds."""
    if kernels_env == "reference":
        monkeypatch.setenv(kernels.ENV, "reference")
    ids = torch.randint(3, 300, (24,), generator=torch.Generator().manual_seed(4))
    model = tiny_family_model(family, max_position_embeddings=64)
    narrow_lm = PortableLM(model)
    state = narrow_lm.new_state(8)
    assert state.kq.dtype == state.vq.dtype == torch.float32
    narrow = _run_all_ways(narrow_lm, ids)
    monkeypatch.setattr(exact, "FP32_INTEGER_BITS", 0)
    wide_lm = PortableLM(model)
    assert wide_lm.new_state(8).kq.dtype == torch.float64
    wide = _run_all_ways(wide_lm, ids)
    for got, want in zip(narrow, wide, strict=True):
        assert _same(got, want)


def test_model_info_counts_the_state_the_model_makes():
    """`seqkv model info`'s expected peak counts a state's bytes as `PortableState` holds them."""
    from seqkv_cli.runtime.footprint import state_bytes

    lm = PortableLM(tiny_family_model("llama", max_position_embeddings=64))
    state = lm.new_state(40)
    held = sum(getattr(state, name).nbytes for name in ("keys", "values", "kq", "vq", "ek", "ev"))
    assert state_bytes(lm.shape, 40) == held
