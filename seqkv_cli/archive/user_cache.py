"""A user's own cache added to an archive (`open_archive(...).add(..., cache=)`): what is kept
of it, and how far it is from the canonical recompute.

The residual policy comes first, checked from the arguments alone before any model work:
which combinations of `residual=`, `tolerance=`, `prompt_length=`/`schedule=` and a cache make
sense, and the label each way of keeping K/V goes by:

    auto      replay if the model reproduces the cache, else a lossless residual
    replay    a replay record only (the cache must be reproduced; replay.py)
    lossless  the residual against the canonical recompute (with a tolerance: above it only)
    none      the canonical recompute

`kv_to_store` then runs the canonical capture and keeps what the policy chose;
`relative_difference` is the distance `add` reports and `max_relative_difference` refuses.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import TYPE_CHECKING, NamedTuple

import torch

from seqkv_cli.archive.replay import Schedule, cache_digest, make_record, reproduced
from seqkv_cli.archive.verify import max_abs_error
from seqkv_cli.errors import SeqkvError
from seqkv_cli.kvcapture.caches import cache_dtype_name, cache_kv, cache_layers
from seqkv_cli.kvcapture.engine import run_capture

if TYPE_CHECKING:
    from seqkv_cli.kvcapture.capture_file import Capture
    from seqkv_cli.runtime.loading import LoadedModel
    from seqkv_cli.sequential.session_codec import SessionCodec

RESIDUAL_CHOICES = ("auto", "replay", "lossless", "none")

# How `load` gets a stored session's K/V back (an AddReport's kv_strategy).
RECOMPUTED = "recomputed"  # tokens only, or residual="none": the canonical recompute
REPLAY = "replay"  # the model re-run under the recorded schedule, checked by digest
EXACT = "exact"  # canonical recompute + a lossless residual
WITHIN_EPS = "within EPS"  # canonical recompute + the residual elements above a tolerance


def check_positive_number(name: str, value: object) -> None:
    """`value` is a finite int or float above 0 (a bool is not a number here; a NaN limit
    compares false with everything, so it would turn the check it sets off)."""
    if (
        not isinstance(value, int | float)
        or isinstance(value, bool)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise SeqkvError(f"{name} must be a finite number > 0, got {value!r}")


def residual_to_use(
    residual: str, tolerance: float | None, *, has_cache: bool, describes_filling: bool
) -> str:
    """The residual choice that applies ("lossless" when a tolerance is given), or a one-line
    refusal of a combination that cannot be meant. `describes_filling`: prompt_length or
    schedule was given (how a cache was filled, which only replay uses)."""
    if residual not in RESIDUAL_CHOICES:
        raise SeqkvError(f"residual must be one of {RESIDUAL_CHOICES}, not {residual!r}")
    if tolerance is not None and residual in ("none", "replay"):
        raise SeqkvError(
            f"tolerance applies to a stored residual; residual={residual!r} keeps none"
        )
    if tolerance is not None:
        check_positive_number("tolerance", tolerance)
        residual = "lossless"
    if describes_filling and residual in ("lossless", "none"):
        raise SeqkvError(
            f"prompt_length and schedule describe how to replay a cache; "
            f"residual={residual!r} does not replay"
        )
    if tolerance is not None and not has_cache:
        raise SeqkvError("tolerance needs a cache: without one K/V are recomputed exactly")
    return residual


def tries_replay(residual: str) -> bool:
    return residual in ("auto", "replay")


def residual_strategy(tolerance: float | None) -> str:
    """The label of a cache kept as a residual against the canonical recompute."""
    return WITHIN_EPS if tolerance is not None else EXACT


def coder_with_tolerance(coder: SessionCodec, tolerance: float):
    """`coder` keeping only the residual elements above `tolerance` (a checked number)."""
    return type(coder).from_config({**coder.get_config(), "tolerance": tolerance})


class StoredKV(NamedTuple):
    # the Capture to store (K/V canonical, or the user's for a residual); None: tokens only
    capture: object
    kv_strategy: str  # how `load` rebuilds the K/V (residual_policy's labels)
    max_abs_difference: float | None  # the user's cache vs the canonical recompute
    note: str | None  # why replay was not used, when it was tried
    relative_difference: float | None  # worst layer's ‖cache - canonical‖ / ‖canonical‖


def kv_to_store(
    lm: LoadedModel,
    runner: torch.nn.Module,
    numerics: str,
    sid: str,
    ids: list[int],
    cache: object,
    *,
    residual: str,
    tolerance: float | None,
    how_filled: tuple[int | None, list[int] | None],
    limit: float | None,
) -> StoredKV:
    """The capture of session `sid` (token `ids`) to store, run under `lm`'s canonical
    `numerics`; `runner` is the user's model that a replay record re-runs. `how_filled`:
    (prompt_length, schedule); `limit`: the max_relative_difference to refuse above."""

    def canonical(dtype: str):
        cap = run_capture(lm, ids, dtype=dtype, numerics=numerics)
        cap.meta["session_id"] = sid
        return cap

    if cache is None:  # tokens only: the encoder takes K/V from its own walk (no capture)
        if how_filled != (None, None):
            raise SeqkvError("prompt_length and schedule describe a cache; none was given")
        return StoredKV(None, RECOMPUTED, None, None, None)
    if residual == "none":  # only the dtype is kept; the cache may be partial
        cap = canonical(cache_dtype_name(cache))
        return StoredKV(cap, RECOMPUTED, partial_difference(cache, cap), None, None)
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
    if tries_replay(residual):
        schedule = Schedule.for_tokens(len(ids), *how_filled)
        rec = make_record(runner, schedule, dtype, cache_digest(keys, values))
        if reproduced(runner, ids, rec) is not None:
            cap.meta["replay"] = rec  # K/V stay canonical: the record rebuilds the cache
            return StoredKV(cap, REPLAY, diff, None, rel)
        note = (
            f"replay did not reproduce the cache (schedule of {len(schedule.calls)} "
            "forward calls; pass prompt_length= for a generate() cache, schedule= for one "
            "continued from a loaded cache)"
        )
        if residual == "replay":
            raise SeqkvError(f"session {sid!r}: {note}")
    cap.keys, cap.values = keys, values
    cap.meta["numeric_path"] = "user-cache"
    return StoredKV(cap, residual_strategy(tolerance), diff, note, rel)


def relative_difference(
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    canon_keys: list[torch.Tensor],
    canon_values: list[torch.Tensor],
) -> tuple[float, int]:
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


def partial_difference(cache: object, cap: Capture) -> float | None:
    """residual='none': how far the user's cache is from what `load` will return, over the
    positions each layer of it holds (the last ones, for a sliding window)."""
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
