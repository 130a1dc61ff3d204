"""How torch's CPU threads behave: they yield the core when idle, and `--threads N` sets them.

OpenMP's default wait policy spins a thread that waits for its siblings; on a shared machine
those spinning threads take the cores the working ones need, and every kernel of a model step
stalls. Measured on the 2-core development VM (`bench/studies/contention.py`, a 120-token `seq`
archive; docs/BENCHMARKS.md "Threads under contention"): with OpenMP's default waits two
decompressions at once took 2.63x one alone and a compress + verify next to a busy process
1.83x; with ``OMP_WAIT_POLICY=PASSIVE`` 1.15x and 0.94x, and alone it was not slower.
So the `seqkv` command sets it (a user's own setting wins), and the thread count stays
torch's (one per core) unless `--threads` says otherwise. The portable path's bits never depend
on the thread count (docs/NUMERICS.md).
"""

from __future__ import annotations

import os

from seqkv_cli.errors import SeqkvError


def yield_when_idle() -> None:
    """Waiting OpenMP threads sleep instead of spinning; must run before torch is imported
    (the runtime reads it once). Library users set OMP_WAIT_POLICY themselves."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


MAX_THREADS = 1024  # beyond any machine's cores; OpenMP aborts on absurd counts


def use_threads(requested: int | None) -> int:
    """Set torch's intra-op threads to `requested` (None: torch's default, one per core)."""
    if requested is not None and (isinstance(requested, bool) or requested < 1):
        raise SeqkvError(f"--threads must be at least 1, got {requested}")
    if requested is not None and requested > MAX_THREADS:
        raise SeqkvError(f"--threads must be at most {MAX_THREADS}, got {requested}")
    import torch

    if requested is not None:
        torch.set_num_threads(requested)
    return torch.get_num_threads()
