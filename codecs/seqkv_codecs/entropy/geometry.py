"""How the GPU kernels spread lanes over threads: shared by the CUDA host code (`rans_cuda`)
and the CPU replay (`rans_lanes_cpu`), so both run the same thread-to-lane assignment."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

MAX_THREADS = 256  # threads per block; the shared scan buffer has one slot per thread
MAX_PER_THREAD = 8  # lanes one decode thread keeps (a local array of this length)
HIST_SHARED = 4096  # alphabets up to this size are counted in shared memory first
TILE_ITEMS = 16  # flags one thread reads per compaction tile
CHUNK_TILES = 4  # compaction tiles per block


@dataclass(frozen=True)
class Geometry:
    """A decode's grid: thread ``g = block * threads + thread`` owns lanes
    ``g * per_thread .. g * per_thread + per_thread - 1`` (those below the lane count)."""

    threads: int
    per_thread: int
    blocks: int


def decode_geometry(
    lanes: int, resident: Callable[[int], int], per_thread: int | None = None
) -> Geometry | None:
    """``per_thread`` lanes per thread if given and its grid fits, else the fewest (a power of
    two) whose grid fits; ``resident(threads)`` is how many blocks of that many threads the
    device holds at once (every lane must be resident: they meet at a barrier each step).
    None when even `MAX_PER_THREAD` does not fit."""
    choices = [per_thread] if per_thread else []
    choices += [1 << p for p in range(MAX_PER_THREAD.bit_length())]
    for k in choices:
        if not 1 <= k <= MAX_PER_THREAD:
            continue
        needed = -(-lanes // k)  # threads with lanes, rounded up to whole warps below
        threads = max(32, min(MAX_THREADS, -(-needed // 32) * 32))
        blocks = -(-lanes // (threads * k))
        if blocks <= resident(threads):
            return Geometry(threads, k, blocks)
    return None
