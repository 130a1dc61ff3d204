"""delta-topk (paper Layer 2): what-if forward, predictor, adaptive quantizer, codec round trip."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from seqkv_cli.errors import SeqkvError
from seqkv_cli.kvcapture.engine import canonical_model, run_capture
from seqkv_cli.runtime.numerics import LEGACY
from seqkv_cli.sequential.branch import branch_kv
from seqkv_cli.sequential.delta_topk import DeltaTopKCodec, flatten_kv, predict_kv, top_k
from seqkv_codecs.adaptive_quant import bits_from_surprisal, dequantize, quantize
from seqkv_codecs.errors import CodecError, CorruptStreamError

TEXT = "Water flows from reservoirs through mains to every tap. " * 2


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models gain nothing from a 2nd thread and lose 100x to spin-waits on a busy machine.

    delta-topk runs on the legacy path only, whose bits hold where the BLAS is row-invariant:
    on some machines only at the default thread count (an Intel Xeon's MKL at 1 thread, seen
    at stop 20), on some not at all; there the module is skipped, saying so."""
    from seqkv_cli.runtime.legacy import check_row_invariance

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    if not check_row_invariance():
        torch.set_num_threads(before)
    if not check_row_invariance():
        pytest.skip("delta-topk needs the legacy path, which this machine's BLAS cannot run")
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def canon(tiny_lm):
    return canonical_model(tiny_lm, LEGACY)  # delta-topk's what-if forward is the legacy one


@pytest.fixture(scope="module")
def cap(tiny_lm):
    ids = tiny_lm.tokenizer(TEXT, add_special_tokens=False).input_ids
    capture = run_capture(tiny_lm, ids, numerics=LEGACY)
    capture.meta["session_id"] = "prose"
    return capture


@pytest.fixture(scope="module")
def greedy(canon):
    """64 tokens the model itself picks greedily: every true token is its top-1 token."""
    ids, state = [72], canon.new_state(64)
    for _ in range(63):
        ids.append(int(canon.forward(state, torch.tensor(ids[-1:]))[0].argmax()))
    return np.array(ids)


def prefill(canon, ids) -> object:
    state = canon.new_state(len(ids))
    for s in range(0, len(ids), 256):
        canon.forward(state, torch.as_tensor(ids[s : s + 256]))
    return state


def rel_error(actual: torch.Tensor, predicted: torch.Tensor) -> float:
    return float((actual[1:] - predicted[1:]).norm() / actual[1:].norm())


def entry(cap) -> dict:
    return {"id": cap.session_id, "positions": cap.positions, "dtype": cap.meta["dtype"]}


# -- what-if forward ---------------------------------------------------------------------------


@pytest.mark.parametrize(("vocab", "k"), [(1, 1), (5, 5), (300, 1), (300, 8), (256_000, 4)])
def test_top_k_is_the_head_of_a_stable_descending_sort(vocab, k):
    """The candidates at or above the k-th value, sorted alone, give what sorting the whole
    vocabulary gave (ties to the lower id), without sorting 256,000 logits per position."""
    g = torch.Generator().manual_seed(vocab + k)
    logits = torch.round(torch.randn(12, vocab, generator=g) * 2)  # many ties
    logits[3] = 1.0  # a row of one value: its first k ids
    logits[5, : min(vocab, 40)] = logits[5].max()  # ties at the top, more than k of them
    values, ids = top_k(logits, k)
    want = torch.sort(logits, dim=-1, descending=True, stable=True)
    assert torch.equal(values, want.values[:, :k]) and torch.equal(ids, want.indices[:, :k])


def test_true_token_rows_reproduce_the_cached_kv_bit_for_bit(canon):
    ids = torch.randint(0, canon.vocab_size, (300,), generator=torch.Generator().manual_seed(1))
    state = prefill(canon, ids)  # 300 positions: rows on both sides of a 256-key block edge
    before = state.keys.clone(), state.values.clone()
    others = torch.randint(0, canon.vocab_size, (300,), generator=torch.Generator().manual_seed(2))
    # true and wrong candidates interleaved, in reverse position order, across several passes
    pos = torch.arange(299, -1, -1).repeat_interleave(2)
    tok = torch.stack([ids.flip(0), others], 1).reshape(-1)
    keys, values = branch_kv(canon, state, pos, canon.embed[tok])
    assert keys.shape == (canon.num_layers, 600, canon.num_kv_heads, canon.head_dim)
    for layer in range(canon.num_layers):
        k, v = state.layer_kv(layer)
        assert torch.equal(keys[layer, ::2].flip(0).transpose(0, 1), k)
        assert torch.equal(values[layer, ::2].flip(0).transpose(0, 1), v)
    assert not torch.equal(keys[-1, 1::2].flip(0).transpose(0, 1), state.layer_kv(1)[0])
    assert torch.equal(state.keys, before[0]) and torch.equal(state.values, before[1])


def test_branch_rows_must_have_their_prefix_cached(canon):
    state = prefill(canon, torch.arange(10))
    with pytest.raises(SeqkvError, match=r"positions 0\.\.10"):
        branch_kv(canon, state, torch.tensor([11]), canon.embed[:1])


# -- predictor ------------------------------------------------------------------------------


def test_top1_on_greedy_text_is_the_exact_kv(canon, greedy):
    state = prefill(canon, greedy)
    pred = predict_kv(canon, greedy, k=1, variant="topk")
    for layer in range(canon.num_layers):
        k, v = state.layer_kv(layer)
        assert torch.equal(pred.keys[layer][:, 1:], k[:, 1:])
        assert torch.equal(pred.values[layer][:, 1:], v[:, 1:])
        assert not pred.keys[layer][:, 0].any()  # position 0 has no distribution: zero


def test_full_vocab_and_linear_predictions_follow_their_definitions(canon, greedy):
    ids = greedy[:24]
    state = prefill(canon, ids)
    logits = canon.forward(canon.new_state(len(ids)), torch.as_tensor(ids))
    full = predict_kv(canon, ids, k=canon.vocab_size, variant="topk")
    linear = predict_kv(canon, ids, k=1, variant="linear")
    vocab = torch.arange(canon.vocab_size)
    for p in (1, 9, 23):
        fk, _ = branch_kv(canon, state, torch.full_like(vocab, p), canon.embed[vocab])
        w = torch.softmax(logits[p - 1].double(), dim=-1)
        expect = torch.einsum("t,lthd->lhd", w, fk.double()).float()
        got = torch.stack([t[:, p] for t in full.keys])
        torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-5)
        soft = torch.softmax(logits[p - 1], dim=-1) @ canon.embed
        _, lv = branch_kv(canon, state, torch.tensor([p]), soft[None])
        torch.testing.assert_close(torch.stack([t[:, p] for t in linear.values]), lv[:, 0])


@pytest.mark.parametrize(("k", "variant"), [(20, "topk"), (258, "topk"), (1, "linear")])
def test_predictions_are_finite_and_beat_a_zero_predictor(canon, greedy, cap, k, variant):
    state = prefill(canon, greedy)
    layers = range(canon.num_layers)
    keys, values = [state.layer_kv(i)[0] for i in layers], [state.layer_kv(i)[1] for i in layers]
    actual = flatten_kv(keys, values)
    pred = predict_kv(canon, greedy, k=k, variant=variant)
    predicted = flatten_kv(pred.keys, pred.values)
    assert torch.isfinite(predicted).all() and rel_error(actual, predicted) < 0.8
    on_text = predict_kv(canon, cap.tokens.numpy(), k=k, variant=variant)
    text_pred = flatten_kv(on_text.keys, on_text.values)
    assert torch.isfinite(text_pred).all()
    if variant == "topk":  # on text it predicts less well (linear: worse than zero here)
        assert rel_error(flatten_kv(cap.keys, cap.values), text_pred) < 1
    assert torch.equal(on_text.surprisal, cap.surprisal)  # the capture's own function and bits


# -- adaptive quantizer -------------------------------------------------------------------------


def test_quantizer_error_bound_and_never_worse_than_zero():
    rng = np.random.default_rng(0)
    r = rng.standard_t(3, size=(90, 256)).astype(np.float32) * rng.exponential(size=(90, 1))
    bits = np.repeat(np.arange(9, dtype=np.uint8), 10)
    data = quantize(r.astype(np.float32), bits, 64, 8)
    out = dequantize(data)
    assert np.array_equal(out.bits, bits) and out.values.dtype == np.float32
    err = np.abs(r.astype(np.float32) - out.values).reshape(90, 4, 64)
    bound = out.error_bound()[..., None]
    kept = bits > 0
    assert np.all(err[kept] <= bound[kept] * (1 + 1e-6))
    assert np.all(bound[kept] <= (out.scales[kept] / (2.0 ** bits[kept, None] - 1))[..., None])
    assert np.all(err <= np.abs(r).reshape(err.shape) * (1 + 1e-6))
    assert not out.values[~kept].any() and not out.scales[~kept].any()
    r = r.astype(np.float32)
    sizes = [len(quantize(r, np.full(90, b, np.uint8), 64, 8)) for b in (2, 4, 8)]
    assert sizes == sorted(sizes) and sizes[0] < sizes[-1] / 2


def test_bit_allocation_rule():
    s = np.array([0.0, 0.4, 1.6, 3.0, 30.0])
    assert bits_from_surprisal(s, base=0, slope=1, max_bits=4).tolist() == [0, 0, 2, 3, 4]
    assert bits_from_surprisal(s, base=2, slope=0.5, max_bits=8).tolist() == [2, 2, 3, 4, 8]
    with pytest.raises(CodecError, match="max_bits"):
        bits_from_surprisal(s, base=0, slope=1, max_bits=9)


def test_quantizer_rejects_bad_input_and_damaged_streams():
    r = np.linspace(-1, 1, 4 * 128, dtype=np.float32).reshape(4, 128)
    bits = np.array([0, 1, 3, 5], dtype=np.uint8)
    with pytest.raises(CodecError, match="NaN"):
        quantize(np.full((4, 128), np.nan, np.float32), bits, 64, 8)
    with pytest.raises(CodecError, match="multiple of vector_len"):
        quantize(r, bits, 60, 8)
    with pytest.raises(CodecError, match="bits must lie"):
        quantize(r, bits, 64, 4)
    data = quantize(r, bits, 64, 8)
    for i in range(len(data)):
        bad = bytearray(data)
        bad[i] ^= 0x10
        with pytest.raises(CorruptStreamError):
            dequantize(bytes(bad))
    for cut in (0, 5, len(data) // 2, len(data) - 1):
        with pytest.raises(CorruptStreamError):
            dequantize(data[:cut])
    with pytest.raises(CorruptStreamError, match="expected 3"):
        dequantize(data, max_positions=3)


# -- the codec ------------------------------------------------------------------------------


def test_config_round_trip_and_bad_configs():
    codec = DeltaTopKCodec(k=5, variant="linear", max_bits=3, base=1.0, slope=0.5)
    config = codec.get_config()
    assert config["id"] == "delta-topk"
    assert DeltaTopKCodec.from_config(config).get_config() == config
    assert DeltaTopKCodec.lossless is False
    for bad in ({"variant": "mean"}, {"k": 0}, {"max_bits": 9}, {"slope": math.inf}, {"x": 1}):
        with pytest.raises(SeqkvError):
            DeltaTopKCodec.from_config({"id": "delta-topk", **bad})


def test_round_trip_restores_tokens_and_surprisal_exactly_and_kv_within_the_bound(canon, cap):
    codec = DeltaTopKCodec(max_bits=4)
    enc = codec.encode(cap, canon)
    assert set(enc.parts) == {"tokens.seq", "delta"}
    assert enc.residual_bytes == len(enc.parts["delta"])
    out = codec.decode(entry(cap), enc.parts.get, canon)
    assert torch.equal(out.tokens, cap.tokens) and torch.equal(out.surprisal, cap.surprisal)
    pred = predict_kv(canon, cap.tokens.numpy(), k=20, variant="topk")
    deq = dequantize(enc.parts["delta"])
    restored = flatten_kv(pred.keys, pred.values) + torch.from_numpy(deq.values)
    assert torch.equal(flatten_kv(out.keys, out.values), restored.bfloat16().float())
    actual = flatten_kv(cap.keys, cap.values)
    bound = torch.from_numpy(deq.error_bound()).repeat_interleave(canon.head_dim, 1)
    assert torch.all((actual - restored).abs() <= bound * (1 + 1e-5) + 1e-6 * actual.abs())
    assert out.keys[0].dtype == torch.bfloat16 and out.keys[0].shape == cap.keys[0].shape


def test_fewer_bits_cost_less_and_zero_bits_return_the_prediction(canon, cap):
    sizes, errors = [], []
    actual = flatten_kv(cap.keys, cap.values)
    for max_bits in (8, 4, 2, 0):
        codec = DeltaTopKCodec(max_bits=max_bits, base=0.0)
        enc = codec.encode(cap, canon)
        out = codec.decode(entry(cap), enc.parts.get, canon)
        sizes.append(len(enc.parts["delta"]))
        errors.append(rel_error(actual, flatten_kv(out.keys, out.values)))
    assert sizes == sorted(sizes, reverse=True) and sizes[-1] < 100
    assert errors == sorted(errors) and errors[0] < 0.02
    pred = predict_kv(canon, cap.tokens.numpy(), k=20, variant="topk")
    for a, b in zip(out.keys + out.values, pred.keys + pred.values, strict=True):
        assert torch.equal(a, b.bfloat16())


def test_damaged_or_missing_delta_streams_raise_codec_errors(canon, cap):
    codec = DeltaTopKCodec(max_bits=2)
    enc = codec.encode(cap, canon)
    delta = enc.parts["delta"]
    for damaged in (delta[:-7], delta[:10], bytes([delta[0] ^ 1]) + delta[1:]):
        parts = {**enc.parts, "delta": damaged}
        with pytest.raises(CodecError):
            codec.decode(entry(cap), parts.get, canon)
    bad = bytearray(delta)
    bad[len(bad) // 2] ^= 0x04
    with pytest.raises(CorruptStreamError):
        codec.decode(entry(cap), {**enc.parts, "delta": bytes(bad)}.get, canon)
    with pytest.raises(SeqkvError, match="missing"):
        codec.decode(entry(cap), {"tokens.seq": enc.parts["tokens.seq"]}.get, canon)
    [result] = codec.decode_many([entry(cap)], [{**enc.parts, "delta": b"xx"}.get], canon)
    assert isinstance(result, CorruptStreamError)


def test_through_a_container(tiny_lm, cap, tmp_path):
    from seqkv_cli.archive import Archive, compress_captures
    from seqkv_cli.kvcapture.capture_file import save_capture

    save_capture(cap, tmp_path / "prose.safetensors")
    codec = {"id": "delta-topk", "max_bits": 3}
    path = tmp_path / "prose.safetensors"
    res = compress_captures([path], tmp_path / "x.skv", codec=codec, model=tiny_lm)
    assert res.part_bytes["delta"] > 0 and res.part_bytes["tokens"] > 0
    with Archive(tmp_path / "x.skv", model=tiny_lm) as arc:
        restored = arc.restore(arc.sessions[0])
    assert torch.equal(restored.tokens, cap.tokens)
    actual = flatten_kv(cap.keys, cap.values)
    assert 0 < rel_error(actual, flatten_kv(restored.keys, restored.values)) < 0.2
