"""Captures: files, metadata, surprisal against an independent transformers forward."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import SAMPLE_DATA
from seqkv_cli import capture, load_capture, to_dynamic_cache
from seqkv_cli.errors import SeqkvError
from seqkv_cli.kvcapture.capture_file import CAPTURE_VERSION, save_capture
from seqkv_cli.runtime.hfcompat import forward_with_cache


def hf_log2_ppl(model, ids: torch.Tensor) -> float:
    """log2 perplexity from one plain transformers forward, independent of seqkv's code."""
    with torch.no_grad():
        logits = model(ids[None]).logits[0, :-1].double()
    nll = torch.nn.functional.cross_entropy(logits, ids[1:], reduction="mean")
    return float(nll) / math.log(2)


@pytest.mark.model
def test_surprisal_matches_independent_perplexity(embedded_lm, tmp_path):
    [res] = capture(
        [str(SAMPLE_DATA / "prose.txt")], model=embedded_lm, out=tmp_path, max_tokens=512
    )
    cap = res.capture
    assert cap.positions == 512 and cap.surprisal.shape == (511,)
    reference = hf_log2_ppl(embedded_lm.model, cap.tokens)
    assert abs(cap.log2_ppl - reference) < 0.01
    assert 2.0 < cap.log2_ppl < 8.0  # a real model on English prose, not noise (log2 V = 15.6)


@pytest.mark.model
def test_capture_file_round_trip_and_metadata(embedded_lm, tmp_path):
    [res] = capture(
        [str(SAMPLE_DATA / "chats.jsonl")][:1], model=embedded_lm, out=tmp_path, max_tokens=64
    )[:1]
    loaded = load_capture(res.path)
    assert torch.equal(loaded.tokens, res.capture.tokens)
    assert torch.equal(loaded.surprisal, res.capture.surprisal)
    assert len(loaded.keys) == 30 and loaded.keys[0].shape == (3, 64, 64)
    assert loaded.keys[0].dtype == torch.bfloat16
    for a, b in zip(loaded.values, res.capture.values, strict=True):
        assert torch.equal(a, b)
    meta = loaded.meta
    assert meta["session_id"] == "chat-01"
    assert meta["model_fingerprint"] == embedded_lm.fingerprint
    assert meta["tokenizer_fingerprint"] == embedded_lm.tokenizer_fingerprint
    assert meta["numeric_path"] == "portable-fx53-v3"
    assert meta["dtype"] == "bf16" and meta["positions"] == 64
    assert set(meta["versions"]) == {"seqkv", "torch", "transformers"}
    # chat sessions go through the chat template
    im_start = embedded_lm.tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert int(loaded.tokens[0]) == im_start


@pytest.mark.model
def test_restored_cache_continues_like_the_original(embedded_lm, tmp_path):
    [res] = capture(
        [str(SAMPLE_DATA / "prose.txt")],
        model=embedded_lm,
        out=tmp_path,
        dtype="fp32",
        max_tokens=200,
    )
    cache = to_dynamic_cache(load_capture(res.path))
    ids = res.capture.tokens
    nxt = torch.tensor([[int(ids[-1])]])
    with torch.no_grad():
        from_cache = forward_with_cache(embedded_lm.model, nxt, cache)[0][0, -1]
        fresh = embedded_lm.model(torch.cat([ids, ids[-1:]])[None]).logits[0, -1]
    assert torch.allclose(from_cache, fresh, atol=2e-3)
    assert int(from_cache.argmax()) == int(fresh.argmax())


def test_tiny_model_capture_canonical_and_ordinary(tiny_lm, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 6)
    [canon] = capture([str(text)], model=tiny_lm, out=tmp_path / "a", dtype="fp32")
    [plain] = capture([str(text)], model=tiny_lm, out=tmp_path / "b", dtype="fp32", canonical=False)
    assert canon.capture.meta["numeric_path"] == "portable-fx53-v3"
    assert plain.capture.meta["numeric_path"].startswith("transformers")
    for a, b in zip(canon.capture.keys, plain.capture.keys, strict=True):
        assert torch.allclose(a, b, atol=1e-4)
    assert abs(canon.capture.log2_ppl - plain.capture.log2_ppl) < 1e-3
    assert abs(canon.capture.log2_ppl - hf_log2_ppl(tiny_lm.model, canon.capture.tokens)) < 1e-3


def test_context_limit_truncate_and_max_tokens(tiny_lm, tmp_path):
    long = tmp_path / "long.txt"
    long.write_text("x" * (tiny_lm.max_context + 10))
    with pytest.raises(SeqkvError, match=r"more than the model context.*--truncate"):
        capture([str(long)], model=tiny_lm, out=tmp_path / "o")
    assert not list((tmp_path / "o").glob("*"))
    [res] = capture([str(long)], model=tiny_lm, out=tmp_path / "o", truncate=True)
    assert res.capture.positions == tiny_lm.max_context
    [res] = capture([str(long)], model=tiny_lm, max_tokens=17)
    assert res.capture.positions == 17 and res.path is None


def test_load_capture_rejects_other_files(tmp_path, tiny_lm):
    from safetensors.torch import save_file

    other = tmp_path / "other.safetensors"
    save_file({"x": torch.zeros(2)}, other)
    with pytest.raises(SeqkvError, match="not a seqkv capture"):
        load_capture(other)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x00" * 20)
    with pytest.raises(SeqkvError, match="not a capture file"):
        load_capture(junk)
    [res] = capture(
        ["-"] if False else [str(SAMPLE_DATA / "prose.txt")], model=tiny_lm, max_tokens=8
    )
    res.capture.meta["format_version"] = "ignored"
    newer = tmp_path / "newer.safetensors"
    save_capture(res.capture, newer)
    from safetensors import safe_open

    with safe_open(str(newer), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
        meta = dict(f.metadata())
    meta["format_version"] = str(CAPTURE_VERSION + 1)
    save_file(tensors, newer, metadata=meta)
    with pytest.raises(SeqkvError, match="newer seqkv"):
        load_capture(newer)


def test_the_same_capture_is_the_same_bytes(tmp_path, tiny_lm):
    """safetensors writes its metadata in a hash map's order, new for every map: the writer
    sorts it, so one capture written again (a restore, a second run) is the same file."""
    import json
    import struct

    [res] = capture([str(SAMPLE_DATA / "prose.txt")], model=tiny_lm, max_tokens=12)
    res.capture.meta.update({f"key_{c}": c * 3 for c in "qwertyuiop"}, session_id='é"\n<x>')
    files = [tmp_path / f"c{i}.safetensors" for i in range(4)]
    for path in files:
        save_capture(res.capture, path)
    first = files[0].read_bytes()
    assert all(path.read_bytes() == first for path in files[1:])
    (length,) = struct.unpack("<Q", first[:8])
    assert length % 8 == 0 and first[8 + length - 1 :][:1] in (b" ", b"}")
    meta = json.loads(first[8 : 8 + length])["__metadata__"]
    assert list(meta) == sorted(meta)
    back = load_capture(files[-1])
    assert torch.equal(back.tokens, res.capture.tokens)
    assert back.meta["session_id"] == 'é"\n<x>' and back.meta["key_q"] == "qqq"
    for a, b in zip(back.keys + back.values, res.capture.keys + res.capture.values, strict=True):
        assert torch.equal(a, b)
