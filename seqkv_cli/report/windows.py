"""Marginal cost along a session: bits per position in windows, next to the surprisal curve.

Containers do not record bits per position, so the curve is modelled from what they do record:

* codecs that range-code token ids under the model (`steps_model`: `seq`, `delta-topk`)
  spend -log2 P(t_i | t_<i) on token i, so their token bits — their own (`tokens`) and
  their share of prefixes stored once for several sessions (`trie`) — follow the capture's
  surprisal (the first token costs what the coder's ideal count says beyond the rest, about
  log2 V);
* every other part — and every part of the other codecs (per-vector codecs, `seq-fast`'s
  unigram table) — costs the same at every position and is spread evenly.

The curve always sums to the row's measured total, so windows add up to the file's bits.
"""

from __future__ import annotations

import numpy as np


def cost_curve(
    model_coded: bool,
    positions: int,
    breakdown: dict[str, float],
    surprisal: np.ndarray | None,
    first_token_bits: float | None = None,
) -> np.ndarray:
    """Bits spent on each position (length `positions`), summing to the row's total."""
    total = float(sum(breakdown.values()))
    n = max(positions, 1)
    token_bits = float(breakdown.get("tokens", 0.0)) + float(breakdown.get("trie", 0.0))
    if not model_coded or surprisal is None or len(surprisal) != positions - 1:
        return np.full(n, total / n)
    first = first_token_bits if first_token_bits is not None else float(np.mean(surprisal))
    shape = np.concatenate([[max(first, 0.0)], np.asarray(surprisal, dtype=np.float64)])
    weight = shape.sum()
    tokens = shape * (token_bits / weight) if weight > 0 else np.full(n, token_bits / n)
    return tokens + (total - token_bits) / n


def windows(curve: np.ndarray, surprisal: np.ndarray | None, size: int) -> list[dict]:
    """Mean bits/position (and mean surprisal) in consecutive windows of `size` positions.

    Surprisal index j belongs to position j + 1 (the first token has none).
    """
    out = []
    for start in range(0, len(curve), size):
        end = min(start + size, len(curve))
        s = None
        if surprisal is not None:
            part = surprisal[max(start - 1, 0) : end - 1]
            s = float(part.mean()) if len(part) else None
        out.append(
            {
                "start": start,
                "end": end,
                "bits_per_position": float(curve[start:end].mean()),
                "surprisal": s,
            }
        )
    return out


def mean_curve(curves: list[np.ndarray]) -> np.ndarray:
    """Position-wise mean over sessions of different lengths (those that reach each position)."""
    if not curves:
        return np.zeros(0)
    longest = max(len(c) for c in curves)
    sums, counts = np.zeros(longest), np.zeros(longest)
    for c in curves:
        ok = ~np.isnan(c)
        sums[: len(c)] += np.where(ok, c, 0.0)
        counts[: len(c)] += ok
    with np.errstate(invalid="ignore"):
        return sums / counts  # NaN where no session has a value
