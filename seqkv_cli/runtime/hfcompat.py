"""transformers 5.x renamed `past_key_values` to `cache`; accept both spellings."""

from __future__ import annotations

import inspect
from functools import cache as _memo


@_memo
def cache_kwarg(forward) -> str:
    """The name `forward` takes its cache under: `cache` (transformers >= 5.x) or the old one."""
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def forward_with_cache(model, input_ids, cache):
    """One forward of `input_ids` (batch, n) continuing `cache` (on the model's device);
    returns (logits on the CPU, cache)."""
    from seqkv_cli.runtime.devices import model_device

    ids = input_ids.to(model_device(model))
    out = model(ids, use_cache=True, **{cache_kwarg(type(model).forward): cache})
    new_cache = getattr(out, "cache", None)
    return out.logits.cpu(), new_cache if new_cache is not None else out.past_key_values
