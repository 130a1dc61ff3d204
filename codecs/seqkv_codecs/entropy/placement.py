"""Where ``backend="auto"`` runs the entropy coder: the CPU (numpy) unless a CUDA device is
selected and the stream is long enough to pay for the GPU's fixed costs.

Both places write the same bytes (docs/format/ENTROPY_STREAM.md, "On a GPU"), so this choice changes
speed only. The device is process-wide, like the runtime's model device: seqkv's commands set
it from ``--device`` for the length of one command (`on_device`); library users call
`use_device`. Nothing here imports numba or torch.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator

# Streams shorter than this stay on the CPU. Provisional, from the CPU side alone (no GPU has
# run the kernels yet): numpy spends ~12 ms on any stream of the per-vector codecs' lane count
# (~1,024 steps of ~12 us each) and ~50 ms on 4M symbols (2 CPU cores); the GPU pays a few
# launches, host round trips and copies per stream, plus seconds of kernel compilation once per
# process. bench/gpu/check.py measures the real crossover and prints the value to put here.
GPU_MIN_SYMBOLS = 1 << 20
ENV_MIN_SYMBOLS = "SEQKV_ENTROPY_GPU_MIN_SYMBOLS"  # overrides GPU_MIN_SYMBOLS (0: every stream)

_device = "cpu"
_gpu_failed: str | None = None  # why the GPU coder could not run here: auto stays on the CPU


def use_device(name: str | None) -> None:
    """Select where ``backend="auto"`` may code: ``"cpu"`` (or None), ``"cuda"``, ``"cuda:N"``."""
    global _device
    name = (name or "cpu").strip().lower()
    if name != "cpu" and name != "cuda" and not name.startswith("cuda:"):
        raise ValueError(f"entropy coder device must be cpu, cuda or cuda:N, not {name!r}")
    _device = name


def device() -> str:
    return _device


@contextlib.contextmanager
def on_device(name: str | None) -> Iterator[None]:
    """`use_device` for the duration of a block, then the device before."""
    before = _device
    use_device(name)
    try:
        yield
    finally:
        use_device(before)


def gpu_min_symbols() -> int:
    """`GPU_MIN_SYMBOLS`, or the value of the `ENV_MIN_SYMBOLS` environment variable."""
    value = os.environ.get(ENV_MIN_SYMBOLS, "").strip()
    return int(value) if value.isdigit() else GPU_MIN_SYMBOLS


def backend_for(n_symbols: int) -> str:
    """``"cuda"`` when a CUDA device is selected, usable, and the stream is long enough;
    else ``"numpy"``."""
    if _device == "cpu" or _gpu_failed is not None or n_symbols < gpu_min_symbols():
        return "numpy"
    from seqkv_codecs.entropy import rans_cuda

    if not rans_cuda.available():
        gpu_failed("numba sees no CUDA GPU")
        return "numpy"
    return "cuda"


def gpu_failed(reason: str) -> None:
    """The GPU coder cannot run in this process: say so once, and code on the CPU from now
    on (the same bytes; only slower)."""
    global _gpu_failed
    if _gpu_failed is None:
        warnings.warn(
            f"seqkv entropy coder stays on the CPU: {reason}", RuntimeWarning, stacklevel=3
        )
    _gpu_failed = reason
