"""Lane-interleaved rANS (32-bit state, 16-bit words) vectorised with numpy.

Symbol ``i`` belongs to lane ``i % lanes`` and step ``i // lanes``; every numpy call works on
one step of all lanes at once, so the Python loop runs ``ceil(n / lanes)`` times, not ``n``.
Words are stored in decode order: step by step, and within a step in lane order, which lets the
decoder take each step's words as one contiguous slice. The encoder keeps every step's candidate
word and flag (3 bytes per symbol) and compacts them once at the end.
"""

from __future__ import annotations

import numpy as np

from seqkv_codecs.entropy import stream
from seqkv_codecs.entropy.freq import decoder_tables, encoder_table
from seqkv_codecs.errors import CorruptStreamError


def encode(
    symbols: np.ndarray, freqs: np.ndarray, precision: int, lanes: int
) -> tuple[np.ndarray, np.ndarray]:
    """Encode ``symbols`` with the static table ``freqs``; return (lane states, words)."""
    n = symbols.size
    steps, last = stream.step_shape(n, lanes)
    packed = encoder_table(freqs)  # one gather per step instead of two
    total = np.uint32(1 << precision)

    flags = np.zeros((steps, lanes), dtype=bool)
    low = np.empty((steps, lanes), dtype=np.uint16)
    x = np.full(lanes, stream.STATE_LOW, dtype=np.uint32)
    s = np.empty(lanes, dtype=np.intp)
    e, f, q = (np.empty(lanes, dtype=np.uint32) for _ in range(3))
    d = np.empty(lanes, dtype=np.float64)
    shift = np.empty(lanes, dtype=np.uint8)
    for t in range(steps - 1, -1, -1):
        k = last if t == steps - 1 else lanes
        xs, ss, es, fs, qs, ds, sh = x[:k], s[:k], e[:k], f[:k], q[:k], d[:k], shift[:k]
        np.copyto(ss, symbols[t * lanes : t * lanes + k], casting="unsafe")
        np.take(packed, ss, out=es)
        np.bitwise_and(es, 0xFFFF, out=fs)
        np.left_shift(fs, 32 - precision, out=qs)  # renormalise while x >= f << (32 - precision)
        flag = flags[t, :k]
        np.greater_equal(xs, qs, out=flag)
        np.copyto(low[t, :k], xs, casting="unsafe")
        np.multiply(flag.view(np.uint8), np.uint8(16), out=sh)
        np.right_shift(xs, sh, out=xs)
        # x + floor(x / f) * (M - f) + cum == (x // f) * M + x % f + cum; float64 division of
        # x < 2**32 by f < 2**16 is exact enough that truncation gives the floor
        np.copyto(ds, fs)
        np.divide(xs, ds, out=ds)
        np.copyto(qs, ds, casting="unsafe")
        np.subtract(total, fs, out=fs)
        np.multiply(qs, fs, out=qs)
        np.add(xs, qs, out=xs)
        np.right_shift(es, 16, out=es)
        np.add(xs, es, out=xs)
    return x, np.compress(flags.ravel(), low.ravel())


def decode(
    states: np.ndarray,
    words: np.ndarray,
    freqs: np.ndarray,
    precision: int,
    n: int,
    out: np.ndarray,
) -> np.ndarray:
    """Decode ``n`` symbols into ``out``; raise CorruptStreamError on an inconsistent end state."""
    lanes = states.size
    steps, last = stream.step_shape(n, lanes)
    slot_sym, slot_packed = decoder_tables(freqs, precision)
    slot_sym = slot_sym.astype(out.dtype)
    mask = (1 << precision) - 1
    n_words = words.size
    words = words.astype(np.uint32)

    x = states.astype(np.uint32)
    slot = np.empty(lanes, dtype=np.intp)
    e, u = np.empty(lanes, dtype=np.uint32), np.empty(lanes, dtype=np.uint32)
    need = np.empty(lanes, dtype=bool)
    pos = 0
    for t in range(steps):
        k = last if t == steps - 1 else lanes
        xs, ss, es, us, ns = x[:k], slot[:k], e[:k], u[:k], need[:k]
        np.bitwise_and(xs, mask, out=ss)
        np.take(slot_sym, ss, out=out[t * lanes : t * lanes + k])
        np.take(slot_packed, ss, out=es)
        np.bitwise_and(es, 0xFFFF, out=us)
        np.right_shift(xs, precision, out=xs)
        np.multiply(xs, us, out=xs)
        np.right_shift(es, 16, out=es)
        np.add(xs, es, out=xs)
        np.less(xs, stream.STATE_LOW, out=ns)
        idx = np.flatnonzero(ns)
        end = pos + idx.size
        if end > n_words:
            raise CorruptStreamError(f"rANS stream ran out of words at symbol {t * lanes}")
        xs[idx] = (xs[idx] << 16) | words[pos:end]
        pos = end
    if pos != n_words:
        raise CorruptStreamError(f"rANS stream has {n_words - pos} unread words")
    if np.any(x != stream.STATE_LOW):
        raise CorruptStreamError("rANS lanes did not end in their initial state")
    return out
