"""Where models run: `--device auto|cpu|cuda[:N]`.

The portable path gives the same bits on a GPU as on a CPU by construction (fixed-point
products exact in fp64, transcendentals from separate mul/add kernels, docs/NUMERICS.md), and
its canary runs on the device before first use, so a device that does not reproduce the
definition is refused rather than trusted. What stays on the CPU: the frequency tables and the
entropy coder (numpy; the same bytes the GPU kernels in seqkv_codecs give, bench/gpu/check.sh)
and every tensor that leaves the runtime — logits and K/V come back to the CPU, so callers
never see a device tensor.

The CLI picks the device per command (`using`, default ``auto``); library users place their
own model and the runtime follows it (`load_model` leaves it on the CPU unless told).
"""

from __future__ import annotations

import contextlib

import torch

from seqkv_cli.errors import SeqkvError

DEFAULT = "auto"
_CPU = torch.device("cpu")
_selected: torch.device = _CPU
_requested = "cpu"  # the name asked for: Ray actors resolve it on their own machine


def cuda_unavailable_reason() -> str | None:
    """None when CUDA can run here, else why not (in words a user can act on)."""
    if torch.version.cuda is None:
        return f"this torch ({torch.__version__}) is a CPU-only build"
    if not torch.cuda.is_available():
        return "torch has CUDA support but sees no GPU (no driver, or CUDA_VISIBLE_DEVICES)"
    return None


def resolve(name: str | None) -> torch.device:
    """The torch device for a `--device` value: auto, cpu, cuda or cuda:N."""
    name = _normal(name)
    if name == "auto":
        return torch.device("cuda") if cuda_unavailable_reason() is None else _CPU
    if name == "cpu":
        return _CPU
    if name == "cuda" or name.startswith("cuda:"):
        has_index, index = ":" in name, name.partition(":")[2]
        if has_index and not (index.isascii() and index.isdigit() and len(index) <= 4):
            raise SeqkvError(f"--device {name}: the GPU index must be a number (cuda:0)")
        reason = cuda_unavailable_reason()
        if reason is not None:
            raise SeqkvError(f"--device {name}: no CUDA device here ({reason}); use --device cpu")
        if has_index and int(index) >= torch.cuda.device_count():
            raise SeqkvError(
                f"--device {name}: this machine has {torch.cuda.device_count()} GPU(s), "
                f"numbered from cuda:0"
            )
        return torch.device(name)
    raise SeqkvError(f"--device {name!r} is not one of auto, cpu, cuda, cuda:N")


def _normal(name: str | None) -> str:
    return (name or DEFAULT).strip().lower()


def use_device(name: str | None) -> torch.device:
    """Select the device that models loaded from now on run on."""
    global _selected, _requested
    _selected = resolve(name)
    _requested = _normal(name)
    return _selected


def requested() -> str:
    """The `--device` value as given (auto, cpu, cuda[:N]): what a worker on another machine
    resolves for itself (`auto` there picks the GPU Ray gave it, if any)."""
    return _requested


@contextlib.contextmanager
def using(name: str | None):
    """`use_device(name)` for the duration of a block (one CLI command), then the old one."""
    before = _selected, _requested
    try:
        yield use_device(name)
    finally:
        _restore(*before)


def _restore(device: torch.device, name: str) -> None:
    global _selected, _requested
    _selected, _requested = device, name


def selected() -> torch.device:
    return _selected


def model_device(model) -> torch.device:
    """The device of a torch module's parameters (CPU for a model without any). Meta
    tensors, which stand for weights held elsewhere (`checkpoint.WeightStore`), do not count."""
    for p in model.parameters():
        if not p.is_meta:
            return p.device
    return _CPU


@torch.inference_mode(False)  # the moved parameters stay ordinary tensors (store.fp32_model)
def place(model):
    """`model` moved to the selected device (in place, as torch does); returned for chaining.
    Meta tensors stay where they are: what they stand for moves when it is used."""
    if model_device(model) == _selected:
        return model
    moved: dict[int, torch.Tensor] = {}  # a tied tensor moves once and stays tied
    for module in model.modules():
        own = [
            *module.named_parameters(recurse=False, remove_duplicate=False),
            *module.named_buffers(recurse=False, remove_duplicate=False),
        ]
        for key, t in own:
            if t is None or t.is_meta:
                continue
            if id(t) not in moved:
                data = t.data.to(_selected)
                moved[id(t)] = (
                    torch.nn.Parameter(data, requires_grad=t.requires_grad)
                    if isinstance(t, torch.nn.Parameter)
                    else data
                )
            setattr(module, key, moved[id(t)])  # a parameter stays one, a buffer a buffer
    return model
