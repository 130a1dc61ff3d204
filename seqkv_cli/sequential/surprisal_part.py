"""The `surprisal` part of a session whose capture's surprisal is not the recompute's.

Written as an `SKS1` stream against the recompute (seqkv_codecs.surprisal_delta, ~34 bits a
position) where that is shorter than the raw float64 values, which older files hold and which
stay readable: a raw part is exactly 8 bytes a value, and a coded one is always shorter, so
the length alone says which one a part is (and a reader from before `SKS1` refuses a coded
part by its length instead of misreading it).
"""

from __future__ import annotations

import numpy as np
import torch

from seqkv_cli.errors import SeqkvError


def encode_surprisal_part(stored: torch.Tensor, recomputed: torch.Tensor) -> bytes:
    from seqkv_codecs.surprisal_delta import encode_surprisal_delta

    values = stored.double().numpy()
    raw = values.astype("<f8").tobytes()
    coded = encode_surprisal_delta(values, recomputed.double().numpy())
    return coded if len(coded) < len(raw) else raw


def decode_surprisal_part(data: bytes, recomputed: torch.Tensor) -> torch.Tensor:
    """The capture's surprisal from its part and the recompute (CorruptStreamError if bad)."""
    from seqkv_codecs.surprisal_delta import apply_surprisal_delta

    n = recomputed.shape[0]
    if not plausible_surprisal_part(data, n):
        raise SeqkvError(f"its stored surprisal holds {len(data)} bytes, not {8 * n}")
    if len(data) == 8 * n:
        return torch.from_numpy(np.frombuffer(data, "<f8").astype(np.float64))
    return torch.from_numpy(apply_surprisal_delta(data, recomputed.double().numpy()))


def plausible_surprisal_part(data: bytes, values: int) -> bool:
    """What a reader can check before any model work: raw, or coded and shorter than raw."""
    from seqkv_codecs.surprisal_delta import MAGIC

    return len(data) == 8 * values or (data[: len(MAGIC)] == MAGIC and len(data) < 8 * values)
