"""How far a user's cache is from this model's canonical recompute (what `add` reports, and
what `max_relative_difference` refuses)."""

from __future__ import annotations

import math

import torch


def relative_difference(keys, values, canon_keys, canon_values) -> tuple[float, int]:
    """The worst layer's ‖cache - canonical‖ / ‖canonical‖ over K and V, and that layer.

    NaN-aware: a NaN or Inf where the recompute is finite is infinitely far (a NaN distance
    used to compare false and skip its layer, so all-NaN K/V read as 0 % away); a non-finite
    element equal to the recompute's own (both NaN, or the same Inf) is no difference.
    """
    worst, at = 0.0, 0
    for i, (k, v, ck, cv) in enumerate(zip(keys, values, canon_keys, canon_values, strict=True)):
        rel = _layer_distance(((k, ck), (v, cv)))
        if rel > worst:
            worst, at = rel, i
        if math.isinf(worst):
            break
    return worst, at


def _layer_distance(pairs) -> float:
    num = den = 0.0
    for mine, canon in pairs:
        a, b = mine.double(), canon.double()
        same = (a == b) | (torch.isnan(a) & torch.isnan(b))
        if not bool(torch.isfinite(a).logical_or(same).all()):
            return math.inf
        finite = torch.isfinite(b)
        num += float(torch.where(same | ~finite, 0.0, a - b).norm()) ** 2
        den += float(torch.where(finite, b, 0.0).norm()) ** 2
    if not math.isfinite(num):
        return math.inf
    return (num / den) ** 0.5 if den > 0 else (0.0 if num == 0 else math.inf)


def partial_difference(cache, cap) -> float | None:
    """residual='none': how far the user's cache is from what `load` will return, over the
    positions each layer of it holds (the last ones, for a sliding window)."""
    from seqkv_cli.api.caches import cache_layers

    worst = 0.0
    for (k, v), ck, cv in zip(cache_layers(cache), cap.keys, cap.values, strict=False):
        if k.dim() != 4 or v.dim() != 4 or k.shape[0] != 1:
            return None
        n = k.shape[-2]
        if n > ck.shape[1] or k.shape[1] != ck.shape[0]:
            return None
        for mine, canon in ((k[0], ck[:, ck.shape[1] - n :]), (v[0], cv[:, cv.shape[1] - n :])):
            if mine.shape != canon.shape:
                return None
            diff = (mine.detach().cpu().double() - canon.double()).abs().max()
            worst = max(worst, float(diff))
    return worst
