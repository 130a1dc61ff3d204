"""What the token coder needs from a language model, and nothing more.

The codec library must not load models; an application hands it any object with this shape
(seqkv_cli wraps its canonical forward in one). The coder's correctness rests on one promise
the protocol cannot express: ``feed`` returns the same float32 bits for a token whether it
arrived in a long prefill chunk or alone (docs/NUMERICS.md). A model that breaks it is caught
by the per-chunk CRC of the token stream, never silently.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

from seqkv_codecs.errors import CodecError


@runtime_checkable
class LogitsModel(Protocol):
    """A causal model stepped through one sequence.

    Attributes
    ----------
    vocab_size : int
        Length V of every logits row.
    """

    vocab_size: int

    def start(self, capacity: int) -> object:
        """A fresh decoding state for a sequence of at most ``capacity`` fed tokens."""
        ...

    def feed(self, state: object, token_ids: np.ndarray) -> np.ndarray:
        """Append ``token_ids`` (M,) int64 to ``state``; return float32 logits (M, V).

        Row j is the next-token distribution after token j, i.e. it predicts the token that
        follows ``token_ids[j]``.
        """
        ...


def feed_checked(model: LogitsModel, state: object, token_ids: np.ndarray) -> np.ndarray:
    """Call ``model.feed`` and refuse output of the wrong shape or type with a clear message."""
    logits = np.asarray(model.feed(state, token_ids))
    expected = (len(token_ids), model.vocab_size)
    if logits.shape != expected or logits.dtype.kind != "f":
        raise CodecError(
            f"the model's feed() returned {logits.dtype} logits of shape {logits.shape}; "
            f"the token coder needs float logits of shape {expected}"
        )
    return logits
