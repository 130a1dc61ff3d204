"""Between llama.cpp's cache rows and a capture's K/V: (kv_heads, positions, head_dim) per layer.

llama.cpp keeps a layer's keys as one row per cell (heads side by side, head_dim fastest) and
values the same way, or transposed (one row per element, cells fastest) when flash attention
is off. For the `llama` architecture the GGUF converter permuted the query/key weights so
llama.cpp's rotary embedding pairs neighbouring dimensions (2i, 2i+1); transformers undoes the
permutation when it loads the GGUF, pairing (i, i + head_dim/2). The same key therefore sits
in llama.cpp's cache with its dimensions interleaved: `to_capture_kv` undoes it,
`from_capture_kv` does it again, so the bytes go back exactly.
"""

from __future__ import annotations

import torch

from seqkv_cli.errors import SeqkvError
from seqkv_cli.llamacpp.layout import GGML_TYPE_IDS, GGML_TYPES
from seqkv_cli.llamacpp.state_file import LayerKV, LlamaState

TORCH_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
# GGUF architectures whose key weights transformers un-permutes on load (its
# LlamaTensorProcessor): their keys are interleaved in llama.cpp's cache.
INTERLEAVED_KEY_ARCHS = frozenset({"llama"})


def _rows(data: bytes, type_id: int, shape: tuple[int, ...]) -> torch.Tensor:
    dtype = TORCH_DTYPES[GGML_TYPES[type_id][0]]
    return torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape)


def to_capture_kv(state: LlamaState, heads: int, head_dim: int, interleaved_keys: bool):
    """Keys and values per layer, (heads, cells, head_dim), in the cache's own dtype."""
    n, width = state.cells, heads * head_dim
    keys, values = [], []
    for i, layer in enumerate(state.layers):
        k_elem = GGML_TYPES[layer.k_type][1]
        v_elem = GGML_TYPES[layer.v_type][1]
        if layer.k_row_bytes != width * k_elem:
            raise SeqkvError(
                f"layer {i} keys have {layer.k_row_bytes // k_elem} elements a cell; the "
                f"model has {heads} KV heads x {head_dim} = {width}: a state of another model?"
            )
        v_width = layer.v_width if state.v_trans else layer.v_unit // v_elem
        if v_width != width:
            raise SeqkvError(
                f"layer {i} values have {v_width} elements a cell; the model has {width}: "
                "a state of another model?"
            )
        k = _rows(layer.k, layer.k_type, (n, heads, head_dim))
        if interleaved_keys:
            k = k.reshape(n, heads, head_dim // 2, 2).transpose(-1, -2).reshape(n, heads, -1)
        if state.v_trans:
            v = _rows(layer.v, layer.v_type, (width, n)).t().reshape(n, heads, head_dim)
        else:
            v = _rows(layer.v, layer.v_type, (n, heads, head_dim))
        keys.append(k.transpose(0, 1).contiguous())
        values.append(v.transpose(0, 1).contiguous())
    return keys, values


def from_capture_kv(
    keys, values, tokens: list[int], layout: dict, interleaved_keys: bool
) -> LlamaState:
    """A llama.cpp state holding these K/V (cast to the layout's cache types)."""
    k_type, v_type = GGML_TYPE_IDS[layout["k_type"]], GGML_TYPE_IDS[layout["v_type"]]
    k_dtype, v_dtype = TORCH_DTYPES[layout["k_type"]], TORCH_DTYPES[layout["v_type"]]
    layers = []
    for k, v in zip(keys, values, strict=True):
        heads, n, head_dim = k.shape
        k = k.to(k_dtype).transpose(0, 1)  # (n, heads, head_dim)
        if interleaved_keys:
            k = k.reshape(n, heads, 2, head_dim // 2).transpose(-1, -2)
        v = v.to(v_dtype).transpose(0, 1).reshape(n, heads * v.shape[-1])
        k_bytes = _bytes(k)
        if layout["v_trans"]:
            v_bytes = _bytes(v.t())
            unit, width = GGML_TYPES[v_type][1], v.shape[1]
        else:
            v_bytes = _bytes(v)
            unit, width = v.shape[1] * GGML_TYPES[v_type][1], 0
        layers.append(
            LayerKV(
                k_type,
                heads * head_dim * GGML_TYPES[k_type][1],
                k_bytes,
                v_type,
                unit,
                width,
                v_bytes,
            )
        )
    return LlamaState(
        layout["kind"],
        list(tokens),
        layout["token_form"],
        layout.get("arch"),
        int(layout["n_stream"]),
        int(layout["stream"]),
        int(layout["seq_id"]),
        bool(layout["v_trans"]),
        layers,
    )


def _bytes(t: torch.Tensor) -> bytes:
    t = t.contiguous()
    # bf16/f16 have no numpy dtype: view the bits as int16 to get the bytes unchanged.
    if t.dtype in (torch.float16, torch.bfloat16):
        t = t.view(torch.int16)
    return t.numpy().tobytes()
