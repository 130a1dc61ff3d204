"""A GGUF file loaded tensor by tensor, its weight matrices kept as the file's blocks.

transformers' own GGUF loader dequantizes every tensor to fp32 at once (and the old
conversion held several such copies: 13 GB for a 0.5B file); here each tensor is read from
the file on its own (a positioned read, so no page of the file stays mapped), and a linear
or embedding weight is kept as its blocks (`formats`): a Q4_K weight costs ~0.56 bytes, Q8_0
~1.06. The names, and what transformers does to a tensor on the way (llama's q/k row
permutation, gemma's norm offset, MoE regrouping), are transformers' own
(`get_gguf_hf_weights_map`, its tensor processors): a processor that only reorders rows is
applied to the blocks' rows; any other change (or a GGUF type `formats` does not hold) makes
that tensor fp32, exactly as transformers would. So every value equals transformers' fp32
load of the file, which is what the fingerprint and the goldens check.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from seqkv_cli.errors import SeqkvError
from seqkv_cli.runtime.checkpoint.formats import BY_GGUF_TYPE, stored_array
from seqkv_cli.runtime.checkpoint.store import StoredTensor, WeightStore, weight_names


def read_bytes(f, offset: int, nbytes: int) -> np.ndarray:
    """``nbytes`` bytes of the open file ``f`` at ``offset``, in memory of this process."""
    out = np.empty(nbytes, dtype=np.uint8)
    view = memoryview(out)
    f.seek(offset)
    done = 0
    while done < nbytes:
        got = f.readinto(view[done:])
        if not got:
            raise SeqkvError(f"the GGUF file ends inside a tensor (at byte {offset + done})")
        done += got
    return out


def _row_order(processor, entry: dict, mapping) -> np.ndarray | None:
    """The row order the tensor processor gives this tensor if all it does is reorder rows
    (identity included); None if it does anything else (then the tensor goes fp32)."""
    if len(entry["shape"]) != 2:
        return None
    rows = int(entry["shape"][0])
    probe = np.arange(rows, dtype=np.float32).reshape(rows, 1)
    try:
        result = processor.process(
            weights=probe,
            name=entry["name"],
            tensor_key_mapping=mapping,
            parsed_parameters={"tensors": {}, "config": {}},
        )
    except Exception:  # a processor that needs the real tensor: it is not a row order
        return None
    order = np.asarray(result.weights)
    if result.name != entry["name"] or order.shape != (rows, 1):
        return None
    order = order[:, 0]
    if not np.array_equal(np.sort(order), np.arange(rows, dtype=np.float32)):
        return None
    return order.astype(np.int64)


def empty_model(config):
    """The model of ``config`` with meta tensors for parameters (buffers are real), tied."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.tie_weights()  # from_config ties real weights only
    return model


def processor_of(config, architecture: str):
    """transformers' tensor processor for a GGUF ``architecture`` (it reads the config by
    transformers' names)."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    return TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config.to_dict())


def name_mapping(model, processor) -> dict[str, str]:
    """transformers' GGUF -> model tensor names (`get_gguf_hf_weights_map`), with gguf-py's
    name table built once instead of once per module (seconds for a 30-layer model)."""
    import functools

    import gguf
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

    original = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.cache(original)
    try:
        return get_gguf_hf_weights_map(model, processor)
    finally:
        gguf.get_tensor_name_map = original


def load_gguf_weights(path: Path, config, table: list[dict], architecture: str, mapping: dict):
    """(model, store) for the GGUF file ``path`` whose transformers config is ``config``,
    whose tensors ``table`` lists, whose ``general.architecture`` is ``architecture`` and
    whose names map to the model's by ``mapping`` (`runtime.gguf.metadata_folder` records
    all four; the table is the one `gguf_check` read from the file's header on this load,
    so every entry lies inside the file): the module holds meta tensors where the store
    holds the file's blocks, fp32 tensors elsewhere."""
    from gguf import GGMLQuantizationType, dequantize

    model = empty_model(config)
    processor = processor_of(config, architecture)
    matrices = weight_names(model)  # names of the linear and embedding weights
    stored: dict[str, StoredTensor] = {}
    dense: dict[str, torch.Tensor] = {}
    regrouped: dict = {"tensors": {}, "config": config.to_dict()}
    with open(path, "rb") as f:
        for entry in table:
            kind = BY_GGUF_TYPE.get(entry["type"])
            target = mapping.get(entry["name"])
            order = _row_order(processor, entry, mapping) if kind is not None else None
            raw = read_bytes(f, entry["offset"], entry["nbytes"])
            raw = raw.reshape(*entry["shape"][:-1], -1)  # rows of bytes, as gguf-py reads them
            if target in matrices and order is not None:
                if not np.array_equal(order, np.arange(len(order))):
                    raw = raw[order]
                held = stored_array(kind, raw.view(np.dtype(kind.numpy)))
                shape = (held.shape[0], kind.elements(held.shape[1]))
                stored[target] = StoredTensor(kind, held, shape)
                continue
            values = dequantize(raw, GGMLQuantizationType(entry["type"]))
            result = processor.process(
                weights=values,
                name=entry["name"],
                tensor_key_mapping=mapping,
                parsed_parameters=regrouped,
            )
            if result.name in mapping:
                dense[mapping[result.name]] = torch.from_numpy(np.copy(result.weights)).float()
    # Processors that regroup tensors (MoE experts) leave them in parsed_parameters.
    dense.update({k: torch.as_tensor(v).float() for k, v in regrouped["tensors"].items()})
    _fill(model, dense, stored)
    return model.eval(), WeightStore.take(model, stored)


def _fill(model, dense: dict[str, torch.Tensor], stored: dict[str, StoredTensor]) -> None:
    """Put the fp32 tensors into the (meta) model; refuse one a weight the file lacks."""
    for name, p in model.named_parameters(remove_duplicate=False):
        if name in dense:
            value = dense[name]
            if tuple(value.shape) != tuple(p.shape):
                raise SeqkvError(
                    f"GGUF tensor for {name} has shape {tuple(value.shape)}, the model expects "
                    f"{tuple(p.shape)}"
                )
            owner, _, attr = name.rpartition(".")
            module = model.get_submodule(owner) if owner else model
            setattr(module, attr, torch.nn.Parameter(value, requires_grad=False))
    missing = [
        name
        for name, p in model.named_parameters(remove_duplicate=False)
        if p.is_meta and name not in stored
    ]
    tied = {n for n in missing if _tied_elsewhere(model, n, stored, dense)}
    missing = [n for n in missing if n not in tied]
    if missing:
        raise SeqkvError(
            f"the GGUF file holds no tensor for {', '.join(missing[:3])}"
            f"{' and others' if len(missing) > 3 else ''} (not a model of this architecture?)"
        )


def _tied_elsewhere(model, name: str, stored, dense) -> bool:
    """Whether parameter ``name`` is the same tensor as one the file does hold (tied)."""
    target = model.get_parameter(name)
    return any(
        other != name and (other in stored or other in dense)
        for other, p in model.named_parameters(remove_duplicate=False)
        if p is target
    )
