"""The report's residual magnitude (95th percentile of |residual| per layer, K and V), checked
against residuals the test makes itself."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch

from cli_run import invoke
from seqkv_cli import load_capture
from seqkv_cli.archive import Archive, compress_captures
from seqkv_cli.errors import SeqkvError
from seqkv_cli.kvcapture.capture_file import save_capture


def _perturbed(cap_path, out):
    """The capture with a known residual: every 7th element of layer 0's keys doubled and
    every 3rd of the last layer's values negated (exact in bf16)."""
    cap = load_capture(cap_path)
    keys, values = [k.clone() for k in cap.keys], [v.clone() for v in cap.values]
    flat = keys[0].view(-1)
    flat[::7] *= 2
    last = values[-1].view(-1)
    last[::3] *= -1
    cap.keys, cap.values = keys, values
    save_capture(cap, out)
    return load_capture(cap_path), cap


def _p95(a, b) -> float:
    return float(np.percentile((a.double() - b.double()).abs().flatten().numpy(), 95))


def test_seq_residual_p95_is_the_residual_it_stores(caps, tiny_lm, tmp_path):
    original, changed = _perturbed(caps[0], tmp_path / "changed.safetensors")
    skv = tmp_path / "seq.skv"
    compress_captures([tmp_path / "changed.safetensors"], skv, codec="seq", model=tiny_lm)
    with Archive(skv, model=tiny_lm) as arc:
        [(_, restored)] = list(arc.restore_many(arc.sessions))
    p95 = restored.residual_p95
    layers = tiny_lm.num_layers
    assert set(p95) == {"key", "value"} and len(p95["key"]) == len(p95["value"]) == layers
    # the canonical capture is what recomputation gives: the residual is the perturbation
    assert p95["key"][0] == _p95(changed.keys[0], original.keys[0]) > 0
    assert p95["value"][-1] == _p95(changed.values[-1], original.values[-1]) > 0
    assert p95["key"][1:] == [0.0] * (layers - 1)
    assert p95["value"][:-1] == [0.0] * (layers - 1)

    # through the CLI: JSON per layer, table and CSV the worst layer, "-" for per-vector
    out = tmp_path / "r.json"
    result = invoke(
        "report", skv, tmp_path / "changed.safetensors", "--codecs", "seq,int8",
        "--model", tiny_lm.source,
        "--json", out, "--csv", tmp_path / "r.csv",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    rows = {r["codec"]: r for r in json.loads(out.read_text())["sessions"]}
    assert rows["seq"]["residual_p95"] == p95 and rows["int8"]["residual_p95"] is None
    assert "residual p95 K / V" in result.output
    csv = pd.read_csv(tmp_path / "r.csv").set_index("codec")
    assert csv.loc["seq", "residual_p95_key_max"] == max(p95["key"])
    assert csv.loc["seq", "residual_p95_value_max"] == max(p95["value"])
    assert np.isnan(csv.loc["int8", "residual_p95_key_max"])


def test_canonical_capture_has_a_zero_residual(full):
    _, _, doc = full
    for row in doc["sessions"]:
        if row["codec"] == "seq":  # canonical captures: the residual stream is empty
            assert set(row["residual_p95"]["key"]) == {0.0}
            assert set(row["residual_p95"]["value"]) == {0.0}
        else:  # raw and turbo3 store K/V themselves
            assert row["residual_p95"] is None


@pytest.fixture
def legacy_threads():
    """delta-topk runs on the legacy path only, whose bits hold where the BLAS is row-invariant
    (on an Intel Xeon's MKL only at one thread, or not at all): None where it cannot run."""
    from seqkv_cli.runtime.legacy import check_row_invariance

    before = torch.get_num_threads()
    for threads in (before, 1):
        torch.set_num_threads(threads)
        if check_row_invariance():
            yield threads
            break
    else:
        yield None
    torch.set_num_threads(before)


def test_delta_topk_residual_p95_is_against_its_prediction(caps, tiny_lm, tmp_path, legacy_threads):
    from seqkv_cli.sequential.delta_topk import predict_kv

    skv = tmp_path / "d.skv"
    if legacy_threads is None:  # refused in one line, before anything is written
        with pytest.raises(SeqkvError, match="this machine's BLAS is not row-invariant"):
            compress_captures([caps[1]], skv, codec="delta-topk", model=tiny_lm, check=False)
        assert not skv.exists()
        pytest.skip("delta-topk needs the legacy path, which this machine's BLAS cannot run")
    compress_captures([caps[1]], skv, codec="delta-topk", model=tiny_lm, check=False)
    with Archive(skv, model=tiny_lm) as arc:
        [(_, restored)] = list(arc.restore_many(arc.sessions))
        k, variant = arc.codec.k, arc.codec.variant
        pred = predict_kv(arc.canonical(), restored.tokens.numpy(), k=k, variant=variant)
    p95 = restored.residual_p95
    pairs = (("key", restored.keys, pred.keys), ("value", restored.values, pred.values))
    for layer in range(tiny_lm.num_layers):
        for kind, got, want in pairs:
            a, b = got[layer].float(), want[layer].float()
            # restored is (prediction + residual) rounded to bf16: each element within one
            # bf16 step of it, and a percentile moves no more than every element does
            step = 2.0**-7 * float(torch.maximum(a.abs().max(), b.abs().max()))
            assert abs(p95[kind][layer] - _p95(a, b)) <= step + 1e-6, (kind, layer)
    assert max(p95["key"] + p95["value"]) > 0
    assert torch.equal(restored.tokens, load_capture(caps[1]).tokens.to(restored.tokens.dtype))
