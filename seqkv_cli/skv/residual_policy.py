"""How a session added with its own cache is kept: the residual choices, which combinations
of `residual=`, `tolerance=`, `prompt_length=`/`schedule=` and a cache make sense, and the
label each way of keeping K/V goes by (checked from the arguments alone, before model work).

    auto      replay if the model reproduces the cache, else a lossless residual
    replay    a replay record only (the cache must be reproduced)
    lossless  the residual against the canonical recompute (with a tolerance: above it only)
    none      the canonical recompute
"""

from __future__ import annotations

import math

from seqkv_cli.errors import SeqkvError

RESIDUAL_CHOICES = ("auto", "replay", "lossless", "none")

# How `load` gets a stored session's K/V back (an AddReport's kv_strategy).
RECOMPUTED = "recomputed"  # tokens only, or residual="none": the canonical recompute
REPLAY = "replay"  # the model re-run under the recorded schedule, checked by digest
EXACT = "exact"  # canonical recompute + a lossless residual
WITHIN_EPS = "within EPS"  # canonical recompute + the residual elements above a tolerance


def check_positive_number(name: str, value) -> None:
    """`value` is a finite int or float above 0 (a bool is not a number here; a NaN limit
    compares false with everything, so it would turn the check it sets off)."""
    if (
        not isinstance(value, int | float)
        or isinstance(value, bool)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise SeqkvError(f"{name} must be a finite number > 0, got {value!r}")


def residual_to_use(residual, tolerance, *, has_cache: bool, describes_filling: bool) -> str:
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


def residual_strategy(tolerance) -> str:
    """The label of a cache kept as a residual against the canonical recompute."""
    return WITHIN_EPS if tolerance is not None else EXACT


def coder_with_tolerance(coder, tolerance):
    """`coder` keeping only the residual elements above `tolerance` (a checked number)."""
    return type(coder).from_config({**coder.get_config(), "tolerance": tolerance})
