"""Surprisal, -log2 P(next | prefix), from logits: torch's definition and the portable one.

A low module of the runtime: the canonical forwards (`canonical`, `portable.model`) and
ordinary runs (`kvcapture.engine`) import it; it imports only `portable.exact`.
"""

from __future__ import annotations

import math

import torch

from seqkv_cli.runtime.portable import elementary

SURPRISAL_ROWS = 4  # rows per float64 log-softmax: stays in cache (profiled: ~6x faster)


def surprisal_bits(logits: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
    """-log2 P(next | prefix) in float64 for each row of fp32 logits (torch's log-softmax).

    Rows are independent: blocking them changes speed, not a bit of the result. Used by
    ordinary runs and the legacy path; the portable path uses `portable_surprisal_bits`.
    """
    ids = next_ids[:, None].long()
    parts = [
        torch.log_softmax(logits[r : r + SURPRISAL_ROWS].double(), dim=-1).gather(
            1, ids[r : r + SURPRISAL_ROWS]
        )[:, 0]
        for r in range(0, len(ids), SURPRISAL_ROWS)
    ]
    lp = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)
    return -lp / math.log(2)


def portable_surprisal_bits(logits: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
    """`surprisal_bits` in the portable definition: the same float64 bits everywhere."""
    ids = next_ids[:, None].long()
    parts = [
        elementary.log_softmax(logits[r : r + SURPRISAL_ROWS].double(), -1).gather(
            1, ids[r : r + SURPRISAL_ROWS]
        )[:, 0]
        for r in range(0, len(ids), SURPRISAL_ROWS)
    ]
    lp = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)
    return -lp / math.log(2)
