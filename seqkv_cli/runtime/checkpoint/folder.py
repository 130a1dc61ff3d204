"""A Hugging Face model folder loaded at its checkpoint's width.

The folder is checked first (`folder_check.check_folder`: its config, its safetensors
headers, the two against each other), so transformers only ever builds a model the files
fill exactly, from the config seqkv checked, never running the folder's own code.
transformers then loads the folder in the dtype its safetensors files hold (its own key
mapping, sharding and conversions, unchanged), and `WeightStore.take` moves the linear and
embedding weights out of the module as they are: a bf16 checkpoint costs 2 bytes a weight,
not the 4 of an fp32 load, and no fp32 copy is ever made of it. The values are those of an
fp32 load (widening is exact). A folder whose files mix float widths is loaded in fp32:
narrowing a wider tensor to the others' dtype would change its values.
"""

from __future__ import annotations

from pathlib import Path

import torch

from seqkv_cli.errors import SeqkvError
from seqkv_cli.runtime.checkpoint.folder_check import FLOAT_DTYPES, check_folder
from seqkv_cli.runtime.checkpoint.store import WeightStore

_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
_FINITE_CHUNK = 1 << 24  # elements checked at a time (bounded temporaries)


def stored_float_dtype(folder: Path, tensors: dict | None = None) -> torch.dtype:
    """The one float dtype of every tensor in the folder's safetensors files (headers only),
    or fp32 where they mix widths."""
    if tensors is None:
        tensors = check_folder(Path(folder)).tensors
    seen = {t.dtype for t in tensors.values() if t.dtype in FLOAT_DTYPES}
    if len(seen) != 1 or next(iter(seen)) not in _DTYPES:
        return torch.float32
    return _DTYPES[next(iter(seen))]


def load_folder(folder: Path, *, check_finite: bool = True):
    """(model, store): the folder's model with its weights in a `WeightStore`, the rest fp32
    (every weight checked finite unless ``check_finite`` is False: files checked before)."""
    from transformers import AutoModelForCausalLM

    checked = check_folder(Path(folder))
    model, info = AutoModelForCausalLM.from_pretrained(
        folder,
        config=checked.config,  # the config checked above, not the file read a second time
        dtype=stored_float_dtype(folder, checked.tensors),
        trust_remote_code=False,
        use_safetensors=True,
        local_files_only=True,
        output_loading_info=True,
    )
    refuse_unfilled(folder, info)
    if check_finite:
        _refuse_non_finite(folder, model)
    store = WeightStore.take(model)
    return model.eval(), store


def refuse_unfilled(folder, info: dict) -> None:
    """transformers' own account of the load, after its key mapping: a weight it had to
    initialise at random, or one it could not place, is refused (checked from the headers
    before; this covers the stacked expert weights whose parts the headers list apart)."""
    for kind, what in (
        ("missing_keys", "the weights have no"),
        ("mismatched_keys", "the weights have a wrongly shaped"),
        ("unexpected_keys", "the weights hold an unexpected"),
    ):
        keys = sorted(str(k if isinstance(k, str) else k[0]) for k in info.get(kind) or ())
        if keys:
            raise SeqkvError(f"{folder}: {what} {keys[0][:100]}; seqkv never fills a weight")


def _refuse_non_finite(folder: Path, model) -> None:
    """A NaN or infinite weight makes every K/V after it NaN; refused by name. One pass over
    the weights as loaded (at their width), a bounded chunk at a time."""
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if not t.is_floating_point() or t.is_meta:
                continue
            flat = t.reshape(-1)
            for start in range(0, flat.numel(), _FINITE_CHUNK):
                if not torch.isfinite(flat[start : start + _FINITE_CHUNK]).all():
                    raise SeqkvError(f"{folder}: weight {name} holds NaN or infinite values")
