"""A Hugging Face model folder loaded at its checkpoint's width.

transformers loads the folder in the dtype its safetensors files hold (its own key mapping,
sharding and conversions, unchanged), and `WeightStore.take` moves the linear and embedding
weights out of the module as they are: a bf16 checkpoint costs 2 bytes a weight, not the 4
of an fp32 load, and no fp32 copy is ever made of it. The values are those of an fp32 load
(widening is exact). A folder whose files mix float widths is loaded in fp32: narrowing a
wider tensor to the others' dtype would change its values.
"""

from __future__ import annotations

from pathlib import Path

import torch

from seqkv_cli.runtime.checkpoint.store import WeightStore

_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def stored_float_dtype(folder: Path) -> torch.dtype:
    """The one float dtype of every tensor in the folder's safetensors files (headers only),
    or fp32 where they mix widths or are not safetensors."""
    from safetensors import safe_open

    seen: set[str] = set()
    files = sorted(Path(folder).glob("*.safetensors"))
    for path in files:
        with safe_open(path, framework="np") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                dtype = f.get_slice(key).get_dtype()
                if dtype in _DTYPES or dtype.startswith("F"):
                    seen.add(dtype)
    if not files or len(seen) != 1 or next(iter(seen)) not in _DTYPES:
        return torch.float32
    return _DTYPES[next(iter(seen))]


def load_folder(folder: Path):
    """(model, store): the folder's model with its weights in a `WeightStore`, the rest fp32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=stored_float_dtype(folder))
    store = WeightStore.take(model)
    return model.eval(), store
