"""What an archive opened with `open_archive` hands back: a listed session (`SessionInfo`) and
what one `add` stored (`AddReport`)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True)
class SessionInfo:
    """One archived session, as `sessions()` lists it."""

    id: str
    tokens: int
    bytes: int  # what this session adds on its own (its tokens past the shared prefix, residual)
    shared_prefix: int  # positions it shares with other sessions
    restore: str  # "replay", "canonical + residual" or "canonical" (how `load` rebuilds K/V)
    # how its tokens load: "small" (decoded by stepping the model), "fast" (read), or "mixed"
    load: str = "small"


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

    @classmethod
    def of(cls, prepared, written: Written, batch: int) -> AddReport:
        """The report of one prepared session of a batch of `batch` that wrote `written`."""
        new = written.new_tokens
        return cls(
            id=prepared.session_id,
            tokens=prepared.tokens,
            # tokens past the stored prefix: every token in a new file; unknown per session
            # in a batch of several
            new_tokens=prepared.tokens if new is None else (new if batch == 1 else None),
            added_bytes=written.added_bytes,
            file_bytes=written.file_bytes,
            kv_strategy=prepared.kept.kv_strategy,
            max_abs_difference=prepared.kept.max_abs_difference,
            note=prepared.kept.note,
            relative_difference=prepared.kept.relative_difference,
        )

    @property
    def kv(self) -> str:
        """Deprecated: `kv_strategy` (the name docs/API.md used before it)."""
        warnings.warn(
            "AddReport.kv is deprecated; use AddReport.kv_strategy",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.kv_strategy


class Written(NamedTuple):
    added_bytes: int
    file_bytes: int
    new_tokens: int | None  # None: a new file (every token is new)


def session_infos(rows: list[dict]) -> list[SessionInfo]:
    """`archive.session_rows`' rows as SessionInfo."""
    return [
        SessionInfo(
            r["id"],
            int(r["positions"]),
            int(r["own_bytes"]),
            int(r["shared_prefix"]),
            r["restore"],
            r["load"],
        )
        for r in rows
    ]
