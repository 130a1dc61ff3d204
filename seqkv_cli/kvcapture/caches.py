"""Between transformers caches and seqkv captures: K/V per layer, (kv_heads, n, head_dim).

A user's cache arrives as whatever their transformers version returns from a forward or
`generate`: a `DynamicCache` (layers with `.keys`/`.values`, or the older
`key_cache`/`value_cache` lists), or the legacy tuple of (key, value) pairs. Batch size 1,
every layer holding the same positions; anything else is refused with one line.
"""

from __future__ import annotations

import torch

from seqkv_cli.errors import SeqkvError
from seqkv_cli.kvcapture.capture_file import DTYPE_NAMES, Capture


def cache_layers(cache: object) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(key, value) per layer of a transformers cache, as stored: (batch, kv_heads, n, hd)."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        pairs = [(getattr(layer, "keys", None), getattr(layer, "values", None)) for layer in layers]
    elif hasattr(cache, "key_cache") and hasattr(cache, "value_cache"):
        pairs = list(zip(cache.key_cache, cache.value_cache, strict=True))
    elif isinstance(cache, tuple | list):
        if not all(isinstance(layer, tuple | list) and len(layer) >= 2 for layer in cache):
            raise SeqkvError("a legacy cache must be a tuple of (key, value) pairs, one per layer")
        pairs = [tuple(layer)[:2] for layer in cache]
    else:
        raise SeqkvError(
            f"cache must be a transformers Cache (e.g. DynamicCache) or a tuple of (key, value) "
            f"pairs, not {type(cache).__name__}"
        )
    if not pairs:
        raise SeqkvError("the cache has no layers")
    for i, (k, v) in enumerate(pairs):
        if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor):
            raise SeqkvError(f"layer {i} of the cache holds no K/V yet (run the model first)")
    return pairs


def cache_positions(cache: object) -> int:
    """The positions a cache holds (its first layer's length; a refusal for a non-cache)."""
    keys = cache_layers(cache)[0][0]
    if not isinstance(keys, torch.Tensor) or keys.dim() != 4:
        raise SeqkvError("the cache's first layer holds no (batch, kv_heads, n, head_dim) keys")
    return int(keys.shape[2])


def cache_dtype_name(cache: object) -> str:
    """The name of the dtype the cache's first layer holds: bf16, fp16 or fp32 (else refused)."""
    dtype = cache_layers(cache)[0][0].dtype
    if dtype not in DTYPE_NAMES:
        raise SeqkvError(f"cache dtype {dtype} is not supported (bf16, fp16 or fp32)")
    return DTYPE_NAMES[dtype]


def cache_kv(cache: object, positions: int, shapes: dict) -> tuple[list, list, str]:
    """Keys and values per layer as a capture holds them, and their dtype name.

    `shapes` is the model's {num_layers, num_kv_heads, head_dim}; `positions` the number of
    tokens the cache must cover."""
    pairs = cache_layers(cache)
    if len(pairs) != shapes["num_layers"]:
        raise SeqkvError(f"the cache has {len(pairs)} layers; the model has {shapes['num_layers']}")
    want = (shapes["num_kv_heads"], shapes["head_dim"])
    name = cache_dtype_name(pairs)
    dtype = pairs[0][0].dtype
    keys, values = [], []
    for i, (k, v) in enumerate(pairs):
        for kind, t in (("key", k), ("value", v)):
            if t.dim() != 4 or t.shape[0] != 1:
                raise SeqkvError(
                    f"layer {i} {kind}s have shape {tuple(t.shape)}; seqkv archives one "
                    "sequence at a time (batch 1: (1, kv_heads, positions, head_dim))"
                )
            if (t.shape[1], t.shape[3]) != want:
                raise SeqkvError(
                    f"layer {i} {kind}s have shape {tuple(t.shape)}; the model's are "
                    f"(1, {want[0]}, positions, {want[1]}): a cache of another model?"
                )
            if t.dtype != dtype:
                raise SeqkvError(f"layer {i} {kind}s are {t.dtype}, layer 0 keys {dtype}")
            if t.shape[2] != positions:
                raise SeqkvError(_length_message(i, int(t.shape[2]), positions))
        keys.append(k[0].detach().to("cpu").contiguous())
        values.append(v[0].detach().to("cpu").contiguous())
    return keys, values, name


def _length_message(layer: int, have: int, want: int) -> str:
    if have == want - 1:
        return (
            f"the cache holds {have} positions and input_ids {want} tokens: after generate() "
            "the last token has no K/V yet; pass the tokens the cache covers "
            f"(input_ids[..., :{have}])"
        )
    if have < want:
        return (
            f"layer {layer} of the cache holds {have} of the {want} positions (a sliding-window "
            "or pruned cache?); add it with residual='none' to store the tokens and recompute "
            "K/V on load"
        )
    return f"layer {layer} of the cache holds {have} positions; input_ids has {want} tokens"


def to_cache(
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    config: object = None,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    upto: int | None = None,
):
    """A `DynamicCache` holding the K/V (batch 1; each layer's first `upto` positions, default
    all), laid out for `config` when given (so sliding-window layers come back as the model
    builds them), in `dtype` on `device` where given (else as stored)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=config) if config is not None else DynamicCache()
    for i, (k, v) in enumerate(zip(keys, values, strict=True)):
        k, v = k[None, :, :upto], v[None, :, :upto]
        if dtype is not None or device is not None:
            k, v = k.to(device=device, dtype=dtype), v.to(device=device, dtype=dtype)
        cache.update(k, v, i)
    return cache


def to_dynamic_cache(
    capture: Capture,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    upto: int | None = None,
):
    """The capture (its first `upto` positions, default all) as a `transformers` DynamicCache
    (batch 1) in `dtype` on `device` (default the CPU), ready to continue generation."""
    return to_cache(capture.keys, capture.values, dtype=dtype, device=device or "cpu", upto=upto)
