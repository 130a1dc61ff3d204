"""Weights held at the checkpoint's width: every value, fingerprint and forward is the one the
model loaded by transformers in fp32 gives (the definition of the stored formats)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bench.real_shapes import byte_tokenizer, write_gguf
from seqkv_cli.errors import SeqkvError
from seqkv_cli.runtime import fingerprint as fp
from seqkv_cli.runtime import native
from seqkv_cli.runtime.checkpoint import KINDS, StoredTensor, WeightStore
from seqkv_cli.runtime.checkpoint.formats import reference_fp32, stored_array
from seqkv_cli.runtime.portable import canary

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # gguf-py on NaN scales


def _random_rows(kind, rows: int, k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind.name == "f32":
        return rng.standard_normal((rows, k)).astype(np.float32)
    if kind.numpy == "uint16":
        return rng.integers(0, 1 << 16, size=(rows, k), dtype=np.uint16)
    return rng.integers(0, 256, size=(rows, kind.row_bytes(k)), dtype=np.uint8)


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal bit patterns; NaN equal to NaN (payloads are not part of the definition)."""
    both_nan = np.isnan(a) & np.isnan(b)
    return bool(np.all((a.view(np.uint32) == b.view(np.uint32)) | both_nan))


@pytest.mark.parametrize("name", sorted(KINDS))
def test_native_decoders_give_gguf_pys_values_on_any_bytes(name):
    """Random bytes reach every branch: subnormal, infinite and NaN scales, every quant."""
    if not native.enabled():
        pytest.skip("numba is not installed")
    kind = KINDS[name]
    for seed in range(3):
        raw = stored_array(kind, _random_rows(kind, 9, 512, seed))
        held = StoredTensor(kind, raw, (9, 512))
        native_rows = held.fp32_rows().numpy()
        with native.reference():
            reference_rows = held.fp32_rows().numpy()
        want = reference_fp32(kind, raw).reshape(9, 512)
        assert _same(native_rows, want) and _same(reference_rows, want)
        picked = held.gather(torch.tensor([[3, 0], [8, 3]])).numpy()
        assert _same(picked.reshape(4, 512), want[[3, 0, 8, 3]])


def test_every_kinds_products_agree_with_the_reference():
    """The canary's check, for all kinds at once: steps, several rows, tiles, every form."""
    assert canary.kernels_agree(tuple(sorted(KINDS)))


def test_limbs_split_every_integer_they_hold_and_refuse_the_rest():
    """x = high·2**16 + low with low in [-2**15, 2**15): at the limbs' edges, and the one
    integer past LIMB_MAX makes the whole row take the per-value path."""
    if not native.enabled():
        pytest.skip("numba is not installed")
    from numba import njit

    from seqkv_cli.runtime.portable import jitted_weights as jw

    limbs_of = njit(lambda x, lo, hi, s, m: jw.limbs_of(x, lo, hi, s, m))
    edge = jw.LIMB_MAX
    x = np.array(
        [0, 1, -1, 2**15 - 1, 2**15, -(2**15), -(2**15) - 1, 2**16, edge, -edge, 123456789]
        + [-987654321] * 21
        + list(range(32)),
        dtype=np.float64,
    )
    lo, hi = np.empty(64, np.int16), np.empty(64, np.int16)
    sums, mass = np.empty(2), np.empty(2)
    assert limbs_of(x, lo, hi, sums, mass)
    assert np.array_equal(hi.astype(np.int64) * 65536 + lo, x.astype(np.int64))
    assert lo.min() >= -(2**15) and lo.max() < 2**15
    assert sums.tolist() == [x[:32].sum(), x[32:].sum()]
    assert mass.tolist() == [np.abs(x[:32]).sum(), np.abs(x[32:]).sum()]
    for beyond in (edge + 1, -edge - 1, 2.0**31):
        y = x.copy()
        y[40] = beyond
        assert not limbs_of(y, lo, hi, sums, mass)


def test_a_damaged_shape_and_an_index_out_of_range_are_refused():
    kind = KINDS["q8_0"]
    raw = stored_array(kind, _random_rows(kind, 2, 64, 0))
    with pytest.raises(SeqkvError, match="cannot be held"):
        StoredTensor(kind, raw, (2, 96))
    with pytest.raises(IndexError):
        StoredTensor(kind, raw, (2, 64)).gather(torch.tensor([2]))


# -- a model folder at its width -------------------------------------------------------------


def _tiny_config(model_type: str = "llama", **extra):
    from transformers import AutoConfig

    values = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 320,
        "max_position_embeddings": 256,
        **extra,
    }
    return AutoConfig.for_model(model_type, **values)


@pytest.fixture(scope="module")
def bf16_folder(tmp_path_factory):
    """A tiny model saved as most hub checkpoints are: bf16 safetensors."""
    from transformers import AutoModelForCausalLM

    from tests.conftest import build_tiny_model

    folder = build_tiny_model(tmp_path_factory.mktemp("bf16") / "m")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.to(torch.bfloat16).save_pretrained(folder)
    return folder


def test_a_bf16_folder_is_held_at_two_bytes_and_reads_as_its_fp32_load(bf16_folder):
    from transformers import AutoModelForCausalLM

    from seqkv_cli.runtime.loading import load_model

    lm = load_model(str(bf16_folder))
    store = lm.weights
    assert set(store.kinds()) == {"bf16"} and store.nbytes == 2 * store.elements
    assert all(p.is_meta for n, p in lm.module.named_parameters() if n.endswith("proj.weight"))
    assert lm.module.lm_head.weight is lm.module.model.embed_tokens.weight  # still tied
    reference = AutoModelForCausalLM.from_pretrained(bf16_folder, dtype=torch.float32)
    assert lm.fingerprint == fp.model_fingerprint(reference, lm.tokenizer_fingerprint)
    want = reference.state_dict()
    got = lm.fp32_model().state_dict()  # the ordinary paths' model: as transformers loads it
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    assert not store.emptied and store.nbytes == 4 * store.elements  # held once, now fp32


def test_weights_made_in_inference_mode_stay_ordinary_tensors(bf16_folder):
    """seqkv's own paths (a capture) make the fp32 model inside inference_mode; the user's
    model must still run with autograd on afterwards, and take in-place edits."""
    from seqkv_cli.runtime.loading import load_model

    lm = load_model(str(bf16_folder))
    with torch.inference_mode():
        model = lm.fp32_model()
    assert not any(p.is_inference() for p in model.parameters())
    embeds = model.get_input_embeddings()(torch.tensor([[3, 4, 5, 6]])).requires_grad_()
    logits = model(inputs_embeds=embeds).logits  # tracked: an inference weight raises here
    assert logits.shape == (1, 4, lm.vocab_size) and logits.requires_grad
    with torch.no_grad():
        model.lm_head.weight.mul_(1.0)


def test_the_portable_forward_of_a_stored_model_is_the_fp32_models(bf16_folder):
    from transformers import AutoModelForCausalLM

    from seqkv_cli.runtime.loading import load_model
    from seqkv_cli.runtime.numerics import build_canonical

    lm = load_model(str(bf16_folder))
    narrow = build_canonical(lm.module, store=lm.weights)
    wide = build_canonical(AutoModelForCausalLM.from_pretrained(bf16_folder, dtype="float32"))
    ids = torch.arange(40) * 7 % lm.vocab_size
    runs = []
    for canon in (narrow, wide):  # a prefill of 30, then 10 steps (the tiled and the step kernels)
        state = canon.new_state(60)
        logits = [canon.forward(state, ids[:30])]
        logits += [canon.forward(state, ids[30 + i : 31 + i]) for i in range(10)]
        runs.append((torch.cat(logits), state.keys[:, :, :40].clone()))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    assert lm.weights.emptied  # the portable path made no fp32 copy


def test_a_model_that_reads_a_weight_outside_a_product_is_refused(bf16_folder):
    from seqkv_cli.runtime.loading import load_model
    from seqkv_cli.runtime.portable.mode import PortableMode

    lm = load_model(str(bf16_folder))
    from seqkv_cli.runtime.portable.weights import WeightCache

    mode = PortableMode(WeightCache(lm.module, lm.weights), "llama")
    weight = lm.module.model.layers[0].mlp.up_proj.weight
    with mode, pytest.raises(SeqkvError, match="reads a weight's values with op"):
        torch.sum(weight * 2.0)


# -- a GGUF file at its width ----------------------------------------------------------------


def _qtypes(name: str) -> str:
    """A mix, as real files have: Q8_0 embeddings, Q4_0/Q4_1/Q5_0/Q5_1 linears, F16 one."""
    if "embed" in name or "lm_head" in name:
        return "Q8_0"
    for part, qtype in (("q_proj", "Q4_0"), ("k_proj", "Q5_0"), ("v_proj", "F16")):
        if part in name:
            return qtype
    return "Q5_1" if "down" in name else "Q4_1"


@pytest.mark.parametrize("tied", [True, False])
def test_a_gguf_file_loads_block_by_block_as_transformers_loads_it(tmp_path, monkeypatch, tied):
    """Against transformers' own GGUF load (fp32): every tensor (llama's q/k row order
    included), the fingerprint, and the portable forward's bits."""
    from transformers import AutoModelForCausalLM

    from seqkv_cli.runtime.loading import load_model
    from seqkv_cli.runtime.numerics import build_canonical

    monkeypatch.setenv("SEQKV_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    write_gguf(_tiny_config(tie_word_embeddings=tied), path, _qtypes, 3, byte_tokenizer(320))
    lm = load_model(str(path))
    assert lm.weights.kinds().keys() == {"q8_0", "q4_0", "q5_0", "f16", "q4_1", "q5_1"}
    reference = AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32
    )
    # as the folder seqkv <= 0.5 converted a GGUF file into records it (the goldens' identity)
    reference.config.architectures = [type(reference).__name__]
    assert lm.fingerprint == fp.model_fingerprint(reference, lm.tokenizer_fingerprint)
    ids = torch.arange(24) * 11 % 320
    outs = []
    for canon in (build_canonical(lm.module, store=lm.weights), build_canonical(reference)):
        state = canon.new_state(24)
        outs.append((canon.forward(state, ids), state.keys[:, :, :24].clone()))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    got = lm.fp32_model().state_dict()
    for name, tensor in reference.state_dict().items():
        assert torch.equal(got[name], tensor), name
    again = load_model(str(path))  # from the metadata cache: the same model
    assert again.fingerprint == lm.fingerprint


def test_a_user_model_object_is_read_in_place():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(_tiny_config())
    store = WeightStore.of_module(model)
    weight = model.model.layers[1].self_attn.o_proj.weight
    held = store.find(weight)
    assert held is not None and held.raw.ctypes.data == weight.data_ptr()  # a view, no copy
    assert store.find(weight.t()) is None  # the transpose is another operand
    assert not store.emptied


def _scaled_rows(kind, rows: int, k: int, seed: int, scale_exponents) -> np.ndarray:
    """Random quants under fp16 scales of chosen binades, as a real checkpoint has them (a
    run's scale is then often a whole number of the row's units, often not)."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, kind.row_bytes(k)), dtype=np.uint8)
    blocks = raw.reshape(-1, kind.block_bytes)
    for n, at in enumerate(kind.halves):
        exps = rng.choice(scale_exponents, size=blocks.shape[0])
        sign = -1.0 if n == 1 and kind.name in ("q4_1", "q5_1") else 1.0  # the min of a run
        values = sign * np.ldexp(1.0 + rng.integers(0, 64, blocks.shape[0]) / 64, exps)
        blocks[:, at : at + 2] = values.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw


@pytest.mark.parametrize("name", sorted(set(KINDS) - {"f32", "f16", "bf16"}))
def test_a_steps_run_sums_are_the_references_integer_sums(name):
    """A one-row step sums a run whose scale (and offset) are whole numbers as c1·Σq·x in
    16-bit limbs, and any other run per value in fp64 lanes: the same bits as the reference,
    with scales as checkpoints have them (whole), in many binades (some not), large, a run
    whose offset cancels its scale (an offset row above the limbs' bound: per value), and
    activations at the L1 form's bound (one-hot: a single integer of 2**31, beyond the
    limbs) or two near 2**30."""
    from seqkv_cli.runtime.portable import exact, kernels
    from seqkv_cli.runtime.portable.weights import StoredRows, WeightCache

    kind, k = KINDS[name], 512
    cases = {
        "checkpoint": _scaled_rows(kind, 24, k, 1, [-9, -8, -7]),
        "mixed binades": _scaled_rows(kind, 24, k, 2, [-30, -12, -8, 3]),
        "large scales": _scaled_rows(kind, 24, k, 3, [14, 15]),
    }
    if name == "q4_1":  # a run of zeros spelled 2**15 · 1 - 2**15 among values ~2**-14: its
        raw = _scaled_rows(kind, 24, k, 5, [-14, -13])  # scale is ~2**50 of the row's units
        run = raw[:, :20]
        run[:, :4] = np.array([2.0**15, -(2.0**15)], np.float16).view(np.uint8)
        run[:, 4:] = 0x11
        cases["cancelling scales"] = raw
    rng = np.random.default_rng(4)
    xs = {
        "normal": torch.from_numpy(rng.standard_normal((1, k)).astype(np.float32)),
        # a single integer of 2**31: beyond the 16-bit limbs, so every run sums per value
        "one-hot": torch.zeros(1, k).index_fill_(1, torch.tensor([7]), 3.0),
        # two integers near 2**30 in one run of 32, the rest small: the limbs' high halves
        "two-hot": torch.zeros(1, k).index_fill_(1, torch.tensor([9, 40]), -2.0) + 1e-6,
    }
    for label, raw in cases.items():
        stored = StoredTensor(kind, stored_array(kind, raw), (24, k))
        rows = StoredRows([stored], WeightCache(torch.nn.Module(), WeightStore()))
        for xname, x in xs.items():
            for form in (exact.L1, exact.PEAK1):
                bits = exact.right_bits(k, form)
                got = rows.product(x, bits, form)
                with kernels.reference():
                    q, e = exact.quantize_rows(stored.fp32_rows(), bits)
                    want = exact.fixed_product(x, bits, q, e, form)
                assert canary.same_bits(got, want), (label, xname, form)
