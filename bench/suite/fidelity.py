"""Fidelity of restored K/V: bit-exactness, max / relative error, and perplexity change.

Perplexity change is what a lossy cache costs a user who continues generation: the restored
K/V of the first positions is handed to transformers as a DynamicCache, the rest of the
session is fed on top of it, and the mean surprisal of those continuation tokens is compared
with the same run on the original (unquantized) cache.
"""

from __future__ import annotations

import math

import torch

CONTINUATION = 128  # tokens scored after the cache (fewer for short sessions)


def kv_errors(originals, restoreds) -> dict:
    """Bit-exactness, max abs error and relative L2 error over every K/V element of a set."""
    from seqkv_cli.archive import same_capture

    num = den = worst = 0.0
    for cap, back in zip(originals, restoreds, strict=True):
        pairs = [*zip(cap.keys, back.keys, strict=True), *zip(cap.values, back.values, strict=True)]
        for a, b in pairs:
            x, y = a.double(), b.double()
            diff = (x - y).nan_to_num(nan=math.inf)
            worst = max(worst, float(diff.abs().max()) if diff.numel() else 0.0)
            num += float(diff.pow(2).sum())
            den += float(x.pow(2).sum())
    return {
        "bit_exact": all(same_capture(a, b) for a, b in zip(originals, restoreds, strict=True)),
        "max_abs_error": worst,
        "rel_l2_error": math.sqrt(num / den) if den else 0.0,
    }


def split_point(positions: int) -> int:
    """Positions kept as cache; the remaining ones are the scored continuation."""
    return positions - max(2, min(CONTINUATION, positions // 4))


@torch.inference_mode()
def continuation_bits(lm, cap, split: int) -> tuple[float, int]:
    """Mean -log2 P of tokens split+1..n-1 when positions < split come from `cap`'s K/V."""
    from transformers import DynamicCache

    from seqkv_cli.kvcapture.engine import surprisal_bits
    from seqkv_cli.runtime.hfcompat import forward_with_cache

    cache = DynamicCache()
    for i, (k, v) in enumerate(zip(cap.keys, cap.values, strict=True)):
        cache.update(k[None, :, :split].float(), v[None, :, :split].float(), i)
    fed = cap.tokens[split:-1]
    logits, _ = forward_with_cache(lm.model, fed[None], cache)
    bits = surprisal_bits(logits[0].float(), cap.tokens[split + 1 :])
    return float(bits.mean()), int(bits.numel())


def perplexity_change(lm, originals, restoreds) -> dict:
    """Δ mean log2 perplexity (bits/token) of continuations, restored vs original caches."""
    ref = new = 0.0
    scored = 0
    for cap, back in zip(originals, restoreds, strict=True):
        split = split_point(cap.positions)
        a, n = continuation_bits(lm, cap, split)
        b, _ = continuation_bits(lm, back, split)
        ref, new, scored = ref + a * n, new + b * n, scored + n
    delta = (new - ref) / scored if scored else 0.0
    return {
        "continuation_tokens": scored,
        "log2_ppl_original_cache": ref / scored if scored else float("nan"),
        "delta_log2_ppl": delta,
        "ppl_ratio": 2.0**delta,
    }
