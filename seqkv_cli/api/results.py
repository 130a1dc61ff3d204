"""What `open_archive`'s archive hands back: a listed session, the report of one `add`."""

from __future__ import annotations

import warnings
from dataclasses import dataclass


@dataclass(frozen=True)
class SessionInfo:
    """One archived session, as `sessions()` lists it."""

    id: str
    tokens: int
    bytes: int  # what this session adds on its own (its tokens past the shared prefix, residual)
    shared_prefix: int  # positions it shares with other sessions
    restore: str  # "replay", "canonical + residual" or "canonical" (how `load` rebuilds K/V)


@dataclass(frozen=True)
class AddReport:
    """What one `add` stored."""

    id: str
    tokens: int
    new_tokens: (
        int | None
    )  # tokens past the longest prefix already stored (None: add_many of several)
    added_bytes: int
    file_bytes: int
    # how `load` gets the K/V back: "recomputed" (tokens only), "replay", "exact" (residual),
    # "within EPS" (residual above a tolerance)
    kv_strategy: str
    max_abs_difference: float | None  # user's cache vs the canonical recompute (None: no cache)
    note: str | None = None  # why replay was not used, when it was tried
    # ‖cache - canonical‖ / ‖canonical‖, worst layer (None: no cache, or residual="none")
    relative_difference: float | None = None

    @property
    def kv(self) -> str:
        """Deprecated: `kv_strategy` (the name docs/API.md used before it)."""
        warnings.warn(
            "AddReport.kv is deprecated; use AddReport.kv_strategy",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.kv_strategy
