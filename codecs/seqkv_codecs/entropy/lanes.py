"""The entropy kernel's per-lane work, written once for every place it runs.

These are plain Python functions over arrays and integers. numba compiles the same source
twice: as CUDA device functions called by the GPU kernels (`rans_cuda`) and as CPU code called
by `rans_lanes_cpu`, which replays the GPU's thread geometry one thread at a time. CI proves
byte identity with the numpy coder on the CPU build (fast) and runs the CUDA kernels themselves
under numba's simulator (slow, small streams), so what runs on a GPU is what CI executed.

Arithmetic is int64 throughout: states are below 2**32 and frequencies below 2**16, so nothing
overflows, and mixing numba's unsigned and signed integers (which it would type as float64) is
avoided. The stream's rules are docs/format/ENTROPY_STREAM.md ("The coder").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from seqkv_codecs.entropy.stream import STATE_LOW

if TYPE_CHECKING:
    from numpy import ndarray

WORD_MASK = 0xFFFF  # numba freezes module-level ints into the compiled code as constants


def encode_lane(
    sym: ndarray,
    n: int,
    lanes: int,
    lane: int,
    table: ndarray,
    shift: int,
    total: int,
    flags: ndarray,
    low: ndarray,
) -> int:
    """Encode one lane, last step first; return its final state (the decoder's start).

    ``table[s]`` is ``freq | cum << 16``; ``shift`` is ``32 - precision``, ``total`` is
    ``2**precision``. For each symbol ``i`` of the lane, ``flags[i]`` says whether encoding it
    emitted a word and ``low[i]`` holds that word: the words in the stream are exactly the
    flagged ``low`` entries in increasing ``i``, which is the format's order (step by step,
    lane by lane), so a prefix sum over ``flags`` places every word without any lane waiting
    for another.
    """
    x = STATE_LOW
    # this lane's symbol count, written out: a kernel's helpers call no other helper
    count = (n - lane + lanes - 1) // lanes if lane < n else 0
    for k in range(count - 1, -1, -1):
        i = k * lanes + lane
        e = table[sym[i]]
        f = e & WORD_MASK
        if x >= f << shift:
            low[i] = x & WORD_MASK
            flags[i] = 1
            x >>= 16
        else:
            flags[i] = 0
        q = x // f
        # (x // f) * M + x % f + cum, without a second division
        x = x + q * (total - f) + (e >> 16)
    return x


def load_lanes(states: ndarray, first: int, count: int, x: ndarray) -> None:
    """The thread's ``count`` lanes from ``first`` on start at their stored states."""
    for k in range(count):
        x[k] = states[first + k]


def decode_lanes(
    t: int,
    lanes: int,
    active: int,
    first: int,
    count: int,
    x: ndarray,
    need: ndarray,
    slot_sym: ndarray,
    slot_packed: ndarray,
    mask: int,
    precision: int,
    out: ndarray,
) -> int:
    """Decode step ``t`` of the thread's lanes ``first .. first + count - 1`` (those below
    ``active``, the lanes the step holds); return how many of them now need a word.

    ``slot_sym[slot]`` is the symbol of a slot, ``slot_packed[slot]`` its
    ``freq | (slot - cum) << 16``; ``need[k]`` is set for the lanes whose state fell below
    2**16 and which read the next word in lane order once the step's word offsets are known.
    """
    wanting = 0
    for k in range(count):
        lane = first + k
        need[k] = 0
        if lane < active:
            v = x[k]
            slot = v & mask
            out[t * lanes + lane] = slot_sym[slot]
            e = slot_packed[slot]
            v = (e & WORD_MASK) * (v >> precision) + (e >> 16)
            x[k] = v
            if v < STATE_LOW:
                need[k] = 1
                wanting += 1
    return wanting


def refill_lanes(
    count: int, x: ndarray, need: ndarray, words: ndarray, pos: int, n_words: int
) -> bool:
    """The lanes that need a word take the next ones from ``words[pos]`` on, in lane order;
    return False when the stream has fewer words than that (corrupt data)."""
    ok = True
    for k in range(count):
        if need[k]:
            if pos < n_words:
                x[k] = (x[k] << 16) | words[pos]
            else:
                ok = False
            pos += 1
    return ok


def lanes_finished(count: int, x: ndarray) -> bool:
    """Every lane of the thread ended in the encoder's initial state (the decoder's check)."""
    for k in range(count):  # noqa: SIM110 (all() of a generator does not compile for CUDA)
        if x[k] != STATE_LOW:
            return False
    return True
