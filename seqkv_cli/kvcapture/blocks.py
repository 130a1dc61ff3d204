"""Moving K/V between torch tensors (captures) and numpy `KVBlock`s (the codec library)."""

from __future__ import annotations

import numpy as np
import torch

from seqkv_codecs.kvblock import KVBlock

_TORCH = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def to_block(tensor: torch.Tensor, dtype: str, kind: str) -> KVBlock:
    t = tensor.detach().to("cpu").contiguous()
    # numpy has no bfloat16: the codec library takes bf16 as raw bits.
    data = t.view(torch.int16).numpy().view(np.uint16) if dtype == "bf16" else t.numpy()
    return KVBlock(data=data, dtype=dtype, kind=kind)


def to_tensor(block: KVBlock) -> torch.Tensor:
    data = np.ascontiguousarray(block.data)
    if block.dtype == "bf16":
        return torch.from_numpy(data.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(data.copy())


def torch_dtype(dtype: str) -> torch.dtype:
    return _TORCH[dtype]
