"""How close restored K/V is to the original: exactness, errors, attention-output error."""

from __future__ import annotations

from dataclasses import dataclass

import torch

PROBE_QUERIES = 16
PROBE_SEED = 0


@dataclass
class LayerFidelity:
    layer: int
    kind: str
    exact: bool
    max_abs: float
    rel_l2: float


def compare(original: torch.Tensor, restored: torch.Tensor, layer: int, kind: str):
    # Compare bits, not values: NaN == NaN and -0.0 != 0.0 for a lossless promise.
    exact = original.dtype == restored.dtype and torch.equal(
        original.contiguous().view(torch.uint8), restored.contiguous().view(torch.uint8)
    )
    a, b = original.float(), restored.float()
    diff = (a - b).nan_to_num(nan=float("inf"))
    max_abs = float(diff.abs().max()) if diff.numel() else 0.0
    rel = float(diff.norm() / a.norm().clamp_min(1e-30)) if diff.numel() else 0.0
    return LayerFidelity(layer, kind, bool(exact), max_abs, rel)


def attention_error(keys, values, keys_hat, values_hat) -> float:
    """Relative L2 error of softmax(q K^T / sqrt(d)) V under a fixed random query probe.

    Captures hold no queries, so a seeded Gaussian probe (same for every file) stands in:
    it weighs errors by how attention would actually mix the values.
    """
    gen = torch.Generator().manual_seed(PROBE_SEED)
    num, den = 0.0, 0.0
    for k, v, kh, vh in zip(keys, values, keys_hat, values_hat, strict=True):
        heads, _, dim = k.shape
        q = torch.randn(heads, PROBE_QUERIES, dim, generator=gen) * (dim**-0.25) * 4
        ref = torch.softmax(q @ k.float().transpose(1, 2) / dim**0.5, -1) @ v.float()
        out = torch.softmax(q @ kh.float().transpose(1, 2) / dim**0.5, -1) @ vh.float()
        num += float((ref - out).pow(2).sum())
        den += float(ref.pow(2).sum())
    return (num / den) ** 0.5 if den else 0.0
