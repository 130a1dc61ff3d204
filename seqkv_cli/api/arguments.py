"""Checks of what the library API is given, shared by `open_archive(...).add` and
`compress_sessions`: session ids, token ids, a session's length against the model context."""

from __future__ import annotations

import numpy as np
import torch

from seqkv_cli.errors import SeqkvError

MAX_ID_CHARS = 1024


def check_session_id(session_id) -> str:
    if not isinstance(session_id, str) or not session_id:
        raise SeqkvError(f"a session id must be a non-empty string, not {session_id!r}")
    if len(session_id) > MAX_ID_CHARS or any(ord(c) < 32 or ord(c) == 127 for c in session_id):
        raise SeqkvError(
            f"session id {session_id[:40]!r}: at most {MAX_ID_CHARS} characters, "
            "no control characters"
        )
    return session_id


def token_list(input_ids, vocab_size: int) -> list[int]:
    """Token ids from a list, a 1-D tensor/array, or a (1, n) batch."""
    arr = input_ids.detach().cpu().numpy() if isinstance(input_ids, torch.Tensor) else input_ids
    try:
        arr = np.asarray(arr)
    except (TypeError, ValueError):
        raise SeqkvError("input_ids must be a list of ints, a tensor or an array") from None
    if arr.ndim == 2 and arr.shape[0] == 1:
        arr = arr[0]
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise SeqkvError(
            f"input_ids must be one sequence of integer ids (n,) or (1, n), got shape "
            f"{tuple(arr.shape)} of {arr.dtype}"
        )
    if arr.size == 0:
        raise SeqkvError("input_ids is empty: nothing to store")
    low, high = int(arr.min()), int(arr.max())
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise SeqkvError(f"token id {bad} is outside the model's vocabulary (0..{vocab_size - 1})")
    return [int(t) for t in arr]


def check_fits_context(session_id: str, ids: list[int], lm) -> None:
    """A session no longer than the model's context (what its canonical forward can run)."""
    if len(ids) > lm.max_context:
        raise SeqkvError(
            f"session {session_id!r} has {len(ids)} tokens, more than the model context "
            f"({lm.max_context})"
        )
