"""How many threads torch's CPU kernels use: `--threads N`, or the cores actually free.

On a shared machine the default (one thread per core) collapses: intra-op threads that wait
for a core held by another process stall every kernel of the step (measured: two restores
on 2 cores 4.7x slower than one, a restore next to busy processes 24x). The portable path's
bits never depend on the thread count (docs/NUMERICS.md), so picking fewer is always safe.
"""

from __future__ import annotations

import os

from seqkv_cli.errors import SeqkvError


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity, else the machine's count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def free_cores(cores: int | None = None, load: float | None = None) -> int:
    """Usable cores minus the runnable load of other processes (1-minute average, rounded
    down, at least one core left): a busy neighbour gets its cores, a quiet machine all."""
    cores = usable_cores() if cores is None else cores
    if load is None:
        try:
            load = os.getloadavg()[0]
        except (AttributeError, OSError):
            return cores
    return max(1, min(cores, cores - int(load)))


def use_threads(requested: int | None) -> int:
    """Set torch's intra-op threads: `requested`, or the free cores when None. Returns it."""
    if requested is not None and (isinstance(requested, bool) or requested < 1):
        raise SeqkvError(f"--threads must be at least 1, got {requested}")
    import torch

    n = requested if requested is not None else free_cores()
    torch.set_num_threads(n)
    return n
