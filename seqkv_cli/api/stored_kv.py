"""What `add` stores for one session's K/V: the canonical run's capture (tokens, surprisal)
and, with the user's cache, a replay record or the cache itself for a residual, chosen by the
residual policy (skv/residual_policy.py); with how far the cache is from the recompute."""

from __future__ import annotations

from types import SimpleNamespace
from typing import NamedTuple

from seqkv_cli.errors import SeqkvError
from seqkv_cli.skv import residual_policy as policy


class StoredKV(NamedTuple):
    capture: object  # the Capture to store (K/V canonical, or the user's for a residual)
    kv_strategy: str  # how `load` rebuilds the K/V (residual_policy's labels)
    max_abs_difference: float | None  # the user's cache vs the canonical recompute
    note: str | None  # why replay was not used, when it was tried
    relative_difference: float | None  # worst layer's ‖cache - canonical‖ / ‖canonical‖


def kv_to_store(
    lm, runner, numerics, sid: str, ids: list[int], cache, *, residual, tolerance, how_filled, limit
) -> StoredKV:
    """The capture of session `sid` (token `ids`) to store, run under `lm`'s canonical
    `numerics`; `runner` is the user's model that a replay record re-runs. `how_filled`:
    (prompt_length, schedule); `limit`: the max_relative_difference to refuse above."""
    from seqkv_cli.api import replay as rp
    from seqkv_cli.api.cache_distance import partial_difference, relative_difference
    from seqkv_cli.api.caches import cache_dtype_name, cache_kv
    from seqkv_cli.kvcapture.engine import run_capture
    from seqkv_cli.skv.verify import max_abs_error

    def canonical(dtype: str):
        cap = run_capture(lm, ids, dtype=dtype, numerics=numerics)
        cap.meta["session_id"] = sid
        return cap

    if cache is None:
        if how_filled != (None, None):
            raise SeqkvError("prompt_length and schedule describe a cache; none was given")
        return StoredKV(canonical("bf16"), policy.RECOMPUTED, None, None, None)
    if residual == "none":  # only the dtype is kept; the cache may be partial
        cap = canonical(cache_dtype_name(cache))
        return StoredKV(cap, policy.RECOMPUTED, partial_difference(cache, cap), None, None)
    shapes = {
        "num_layers": lm.num_layers,
        "num_kv_heads": lm.num_kv_heads,
        "head_dim": lm.head_dim,
    }
    keys, values, dtype = cache_kv(cache, len(ids), shapes)
    cap = canonical(dtype)
    diff = max_abs_error(cap, SimpleNamespace(keys=keys, values=values))
    rel, layer = relative_difference(keys, values, cap.keys, cap.values)
    if limit is not None and rel > limit:
        raise SeqkvError(
            f"session {sid!r}: its cache is {rel:.3g} away from this model's "
            f"recompute (relative, layer {layer}; at most {limit:g} allowed): a cache "
            f"of another model? (this one is {lm.name}, fingerprint "
            f"{lm.fingerprint[:16]})"
        )
    note = None
    if policy.tries_replay(residual):
        schedule = rp.Schedule.for_tokens(len(ids), *how_filled)
        rec = rp.make_record(runner, schedule, dtype, rp.cache_digest(keys, values))
        if rp.reproduced(runner, ids, rec) is not None:
            cap.meta["replay"] = rec  # K/V stay canonical: the record rebuilds the cache
            return StoredKV(cap, policy.REPLAY, diff, None, rel)
        note = (
            f"replay did not reproduce the cache (schedule of {len(schedule.calls)} "
            "forward calls; pass prompt_length= for a generate() cache, schedule= for one "
            "continued from a loaded cache)"
        )
        if residual == "replay":
            raise SeqkvError(f"session {sid!r}: {note}")
    cap.keys, cap.values = keys, values
    cap.meta["numeric_path"] = "user-cache"
    return StoredKV(cap, policy.residual_strategy(tolerance), diff, note, rel)
