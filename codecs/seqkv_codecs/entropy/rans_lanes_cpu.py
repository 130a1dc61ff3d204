"""The GPU kernel's lane code (`lanes`) compiled for the CPU by numba, in the GPU's geometry.

This is how CI proves, on thousands of streams and without a GPU, that the source the CUDA
kernels run writes and reads the numpy coder's bytes: the same `lanes` functions, the same
thread-to-lane assignment (`geometry.decode_geometry`), the same word offsets (every thread
reads its words after those of all lanes before it), one thread after another instead of all
at once. What it does not replay is the CUDA plumbing around them (shared-memory scans, the
grid barrier, the compaction kernels): numba's CUDA simulator runs those, on smaller streams
(tests/codecs/test_entropy_kernel.py).

Not a user-facing backend: numpy stays the CPU coder (same bytes). numba is imported on first
use only.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from seqkv_codecs.entropy import lanes as lane_code
from seqkv_codecs.entropy import stream
from seqkv_codecs.entropy.freq import decoder_tables, encoder_table
from seqkv_codecs.entropy.geometry import MAX_PER_THREAD, decode_geometry
from seqkv_codecs.errors import CorruptStreamError


def encode_symbols(symbols: np.ndarray, alphabet_size: int, lanes: int | None = None) -> bytes:
    """A stream of ``symbols`` (1-D, non-negative integers below ``alphabet_size``: unchecked,
    this is a test's tool) coded by the kernel source."""
    counts = np.bincount(symbols, minlength=alphabet_size).astype(np.int64)
    return stream.encode_stream(
        counts,
        symbols.size,
        alphabet_size,
        lanes,
        lambda freqs, precision, lanes: encode(symbols, freqs, precision, lanes),
    )


def decode_symbols(data: bytes | memoryview, per_thread: int | None = None) -> np.ndarray:
    """`decode` of a stream's bytes."""
    return decode(stream.unpack(data), per_thread)


def encode(
    symbols: np.ndarray, freqs: np.ndarray, precision: int, lanes: int
) -> tuple[np.ndarray, np.ndarray]:
    """(lane states, words) of ``symbols``: a `stream.LaneCoder`, as `rans_numpy.encode`."""
    n = symbols.size
    flags = np.empty(n, np.uint8)
    low = np.empty(n, np.uint16)
    states = np.empty(lanes, np.int64)
    table = encoder_table(freqs).astype(np.int64)
    _compiled().encode(symbols, n, lanes, table, 32 - precision, 1 << precision, flags, low, states)
    return states.astype(np.uint32), low[flags.view(bool)]


def decode(parsed: stream.Stream, per_thread: int | None = None) -> np.ndarray:
    """Decode a parsed stream with the GPU's thread geometry for its lane count (the grid is
    as large as it needs to be: a CPU has no limit on resident blocks)."""
    out = np.empty(parsed.n_symbols, stream.symbol_dtype(parsed.alphabet_size))
    if parsed.states.size == 0:
        out.fill(int(np.argmax(parsed.freqs)))
        return out
    lanes = parsed.states.size
    geometry = decode_geometry(lanes, lambda threads: 1 << 62, per_thread)
    slot_sym, slot_packed = decoder_tables(parsed.freqs, parsed.precision)
    steps, last = stream.step_shape(parsed.n_symbols, lanes)
    status = np.zeros(3, np.int64)
    _compiled().decode(
        parsed.states.astype(np.int64), parsed.words, parsed.words.size, slot_sym.astype(out.dtype),
        slot_packed.astype(np.int64), parsed.precision, lanes, steps, last,
        geometry.blocks * geometry.threads, geometry.per_thread, out, status,
    )  # fmt: skip
    overrun, unfinished, read = (int(v) for v in status)
    if overrun or read > parsed.words.size:
        raise CorruptStreamError("rANS stream ran out of words")
    if read != parsed.words.size:
        raise CorruptStreamError(f"rANS stream has {parsed.words.size - read} unread words")
    if unfinished:
        raise CorruptStreamError("rANS lanes did not end in their initial state")
    return out


@functools.cache
def _compiled() -> Any:
    from types import SimpleNamespace

    import numba

    jit = numba.njit(nogil=True)
    encode_lane = jit(lane_code.encode_lane)
    load_lanes = jit(lane_code.load_lanes)
    decode_lanes = jit(lane_code.decode_lanes)
    refill_lanes = jit(lane_code.refill_lanes)
    lanes_finished = jit(lane_code.lanes_finished)

    @numba.njit(nogil=True)
    def encode_all(sym, n, lanes, table, shift, total, flags, low, states):
        for lane in range(lanes):  # the encode kernel's threads, one after another
            states[lane] = encode_lane(sym, n, lanes, lane, table, shift, total, flags, low)

    @numba.njit(nogil=True)
    def decode_all(states, words, n_words, slot_sym, slot_packed, precision, lanes, steps, last,
                   threads, per_thread, out, status):  # fmt: skip
        x = np.zeros((threads, MAX_PER_THREAD), np.int64)
        need = np.zeros((threads, MAX_PER_THREAD), np.int64)
        wanting = np.zeros(threads, np.int64)
        owned = np.zeros(threads, np.int64)
        for g in range(threads):
            first = g * per_thread
            owned[g] = min(per_thread, lanes - first) if first < lanes else 0
            load_lanes(states, first, owned[g], x[g])
        mask = (1 << precision) - 1
        pos = 0
        for t in range(steps):
            active = last if t == steps - 1 else lanes
            for g in range(threads):
                wanting[g] = decode_lanes(
                    t, lanes, active, g * per_thread, owned[g], x[g], need[g], slot_sym,
                    slot_packed, mask, precision, out,
                )  # fmt: skip
            # on the GPU: the blocks before, plus the threads before in the block (two scans)
            for g in range(threads):
                if not refill_lanes(owned[g], x[g], need[g], words, pos, n_words):
                    status[0] = 1
                pos += wanting[g]
        for g in range(threads):
            if not lanes_finished(owned[g], x[g]):
                status[1] = 1
        status[2] = pos

    return SimpleNamespace(encode=encode_all, decode=decode_all)
