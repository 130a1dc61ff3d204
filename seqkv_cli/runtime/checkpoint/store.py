"""A model's weight matrices held once, at their checkpoint's width, beside a module that
keeps only their shapes.

A loaded model's linear and embedding weights (every `nn.Linear` / `nn.Embedding` weight) are
taken out of the module into a `WeightStore`: each is a `StoredTensor`, the checkpoint's own
bytes (fp32, bf16, fp16 or GGUF blocks), and the module keeps a meta tensor of the same shape
in its place — an fp32 copy is never made unless a caller asks for one. Everything else
(norms, biases, stacked expert weights, buffers) stays an ordinary fp32 tensor in the module.

Who reads what: the portable forward makes the definition's integers from the stored bytes
where it multiplies (`runtime.portable.weights`); an embedding lookup decodes the rows it
needs; `fp32_model` puts fp32 parameters back for the ordinary transformers paths (a
`--no-canonical` capture, generation), after which each entry is an fp32 view of its
parameter, so the weights are still held once. A user's own model object is never emptied:
its entries are views of its fp32 parameters (`WeightStore.of_module`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from seqkv_cli.errors import SeqkvError
from seqkv_cli.runtime import native
from seqkv_cli.runtime.checkpoint.formats import KINDS, Kind, reference_fp32, stored_array

_TORCH_KINDS = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
ROW_CHUNK = 1 << 22  # elements decoded at a time where a whole matrix is walked (hashing)


class StoredTensor:
    """One weight matrix (N, K) as its checkpoint holds it: `raw` (N, stored columns)."""

    def __init__(self, kind: Kind, raw: np.ndarray, shape: tuple[int, int]) -> None:
        self.kind, self.raw, self.shape = kind, raw, (int(shape[0]), int(shape[1]))
        if raw.shape[0] != self.shape[0] or kind.elements(raw.shape[1]) != self.shape[1]:
            raise SeqkvError(
                f"a {kind.name} weight of shape {self.shape} cannot be held in {raw.shape} "
                "stored elements (a damaged checkpoint?)"
            )

    @classmethod
    def of_tensor(cls, t: torch.Tensor) -> StoredTensor:
        """A 2-D CPU float tensor as it is (a view, no copy): fp32, bf16 or fp16; any other
        dtype is held as its fp32 values (a copy)."""
        t = t.detach()
        if t.dtype not in _TORCH_KINDS:
            t = t.float()
        kind = KINDS[_TORCH_KINDS[t.dtype]]
        data = t.contiguous()
        array = data.view(torch.int16).numpy() if kind.numpy == "uint16" else data.numpy()
        return cls(kind, stored_array(kind, array), tuple(t.shape))

    @property
    def nbytes(self) -> int:
        return int(self.raw.nbytes)

    def fp32_rows(self, rows: np.ndarray | None = None) -> torch.Tensor:
        """The fp32 values of rows ``rows`` (all by default), (len(rows), K), a new tensor."""
        if self.kind.name == "f32" and rows is None:
            return torch.from_numpy(self.raw)
        index = np.arange(self.shape[0]) if rows is None else np.asarray(rows, dtype=np.int64)
        if native.enabled():
            from seqkv_cli.runtime.checkpoint.jitted_decode import to_fp32

            return torch.from_numpy(to_fp32(self.kind.name, self.raw, index))
        return torch.from_numpy(np.ascontiguousarray(reference_fp32(self.kind, self.raw[index])))

    def fp32_chunks(self, elements: int = ROW_CHUNK) -> Iterator[torch.Tensor]:
        """The fp32 rows in order, about ``elements`` at a time (at least one row)."""
        step = max(1, elements // max(1, self.shape[1]))
        for start in range(0, self.shape[0], step):
            yield self.fp32_rows(np.arange(start, min(start + step, self.shape[0])))

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        """``embedding(weight, ids)``: the fp32 rows of ``ids``, shaped ids.shape + (K,)."""
        flat = ids.reshape(-1).cpu().numpy()
        if flat.size and (flat.min() < 0 or flat.max() >= self.shape[0]):
            raise IndexError(f"index out of range for an embedding of {self.shape[0]} rows")
        return self.fp32_rows(flat).view(*ids.shape, self.shape[1]).to(ids.device)


@dataclass
class Entry:
    """A stored weight and where the module keeps it (a tied weight: several places)."""

    stored: StoredTensor
    places: list[tuple[torch.nn.Module, str]]
    param: torch.Tensor  # what the module holds now: a meta tensor, or its fp32 parameter


def _weight_places(model) -> dict[int, tuple[torch.Tensor, list]]:
    """id(weight) -> (weight, [(module, "weight")...]) for every linear and embedding weight."""
    found: dict[int, tuple[torch.Tensor, list]] = {}
    for module in model.modules():
        if not isinstance(module, torch.nn.Linear | torch.nn.Embedding):
            continue
        w = dict(module.named_parameters(recurse=False, remove_duplicate=False)).get("weight")
        if w is None or w.dim() != 2:
            continue
        found.setdefault(id(w), (w, []))[1].append((module, "weight"))
    return found


def weight_names(model) -> set[str]:
    """The names (aliases of a tied weight included) of a model's linear and embedding weights."""
    places = _weight_places(model)
    return {name for name, p in model.named_parameters(remove_duplicate=False) if id(p) in places}


def _storage_key(t: torch.Tensor) -> int:
    """Which storage ``t`` views: the parameter and every view of it (a linear's ``t()``,
    made by aten ops that set no ``_base`` under inference mode) share one. A meta tensor has
    a storage object too, without memory."""
    return t.untyped_storage()._cdata


class WeightStore:
    """The stored weight matrices of one model, looked up by the storage of the tensor the
    module holds in their place (a meta tensor, or the model's own fp32 parameter)."""

    def __init__(self, entries: dict[int, Entry] | None = None) -> None:
        self._entries: dict[int, Entry] = entries or {}

    # -- building ----------------------------------------------------------------------------

    @classmethod
    def of_module(cls, model) -> WeightStore:
        """Entries that are views of a model's own fp32 CPU weights (nothing is copied, the
        module is left as it is): how a user's model object is read."""
        entries = {}
        for w, places in _weight_places(model).values():
            if w.device.type != "cpu" or w.dtype != torch.float32:
                raise SeqkvError("the portable forward reads fp32 weights on the CPU")
            entries[_storage_key(w)] = Entry(StoredTensor.of_tensor(w), places, w)
        return cls(entries)

    @classmethod
    def take(cls, model, stored: dict[str, StoredTensor] | None = None) -> WeightStore:
        """Move a model's linear and embedding weights into a store, leaving meta tensors.

        A weight named in ``stored`` (by its module path + ".weight") is held as given
        there (a loader that read the checkpoint itself); any other is held as the module's
        tensor is (its dtype's width, a view). Returns the store; the module keeps fp32
        tensors everywhere else (converted where the checkpoint was narrower)."""
        names: dict[int, list[str]] = {}
        for n, p in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(n)
        entries = {}
        for w, places in _weight_places(model).values():
            aliases = names.get(id(w), [])
            given = next((stored[n] for n in aliases if n in (stored or {})), None)
            if given is None and w.is_meta:
                raise SeqkvError(f"no weights were read for {' / '.join(aliases) or 'a weight'}")
            held = given if given is not None else StoredTensor.of_tensor(w.data)
            if held.shape != tuple(w.shape):
                raise SeqkvError(
                    f"{' / '.join(aliases)}: the checkpoint holds {held.shape}, the model "
                    f"expects {tuple(w.shape)}"
                )
            meta = torch.nn.Parameter(
                torch.empty(held.shape, dtype=torch.float32, device="meta"), requires_grad=False
            )
            for module, attr in places:
                setattr(module, attr, meta)
            entries[_storage_key(meta)] = Entry(held, places, meta)
        for name, p in model.named_parameters():
            if not p.is_meta and p.dtype != torch.float32:
                _set_param(model, name, p.data.float())
        for name, b in model.named_buffers():
            if b.is_floating_point() and b.dtype != torch.float32:
                _set_buffer(model, name, b.float())
        return cls(entries)

    # -- reading -----------------------------------------------------------------------------

    def find(self, t: torch.Tensor) -> StoredTensor | None:
        """The stored weight ``t`` is, as the module holds it (the parameter itself, or a view
        of it with the same shape and strides, as a linear's ``t().t()``); None otherwise."""
        entry = self._entries.get(_storage_key(t))
        if entry is None:
            return None
        p = entry.param
        if (
            t.shape == p.shape
            and t.stride() == p.stride()
            and t.storage_offset() == p.storage_offset()
        ):
            return entry.stored
        if p.is_meta:
            raise SeqkvError(
                "portable numerics: the model reads a stored weight through a view of another "
                f"shape {tuple(t.shape)} (of {tuple(p.shape)}); this architecture is not "
                "supported at the checkpoint's width"
            )
        return None

    def is_stored(self, t: torch.Tensor) -> bool:
        return _storage_key(t) in self._entries

    def __iter__(self) -> Iterator[StoredTensor]:
        return (e.stored for e in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        """Bytes the stored weights hold (each tied weight once)."""
        return sum(e.stored.nbytes for e in self._entries.values())

    @property
    def elements(self) -> int:
        return sum(e.stored.shape[0] * e.stored.shape[1] for e in self._entries.values())

    def kinds(self) -> dict[str, int]:
        """Elements held per kind (`model info`)."""
        out: dict[str, int] = {}
        for e in self._entries.values():
            n = e.stored.shape[0] * e.stored.shape[1]
            out[e.stored.kind.name] = out.get(e.stored.kind.name, 0) + n
        return out

    @property
    def emptied(self) -> bool:
        """Whether the module holds meta tensors in place of (some of) its weights."""
        return any(e.param.is_meta for e in self._entries.values())

    # -- fp32 for the ordinary paths ---------------------------------------------------------

    # Parameters made inside a caller's inference_mode would be inference tensors for good:
    # the user's own forward with autograd on (or an in-place edit) would then fail.
    @torch.inference_mode(False)
    def fp32_model(self, model, device=None):
        """Put fp32 parameters back into ``model`` (on ``device``, default the CPU; each entry
        then a view of its parameter, the stored bytes released): the ordinary transformers
        paths run it as loaded in fp32. Idempotent; returns the model."""
        for key, entry in list(self._entries.items()):
            if not entry.param.is_meta:
                continue
            values = entry.stored.fp32_rows().to(device or "cpu")
            full = torch.nn.Parameter(values, requires_grad=False)
            for module, attr in entry.places:
                setattr(module, attr, full)
            del self._entries[key]
            held = (
                StoredTensor.of_tensor(full.data) if values.device.type == "cpu" else entry.stored
            )
            self._entries[_storage_key(full)] = Entry(held, entry.places, full)
        return model

    def update_digest(self, h, name: str, t: torch.Tensor) -> bool:
        """Hash ``t``'s fp32 bytes (what `fingerprint.weights_digest` hashes for a parameter
        of that name) into ``h`` if ``t`` is stored; False if it is not."""
        stored = self.find(t) if self.is_stored(t) else None
        if stored is None:
            return False  # not stored, or a view of another shape (hashed as it is)
        h.update(f"{name}:{torch.float32}:{stored.shape}\n".encode())
        for chunk in stored.fp32_chunks():
            h.update(chunk.contiguous().numpy().tobytes())
        return True


def _set_param(model, name: str, value: torch.Tensor) -> None:
    owner, _, attr = name.rpartition(".")
    module = model.get_submodule(owner) if owner else model
    setattr(module, attr, torch.nn.Parameter(value, requires_grad=False))


def _set_buffer(model, name: str, value: torch.Tensor) -> None:
    owner, _, attr = name.rpartition(".")
    module = model.get_submodule(owner) if owner else model
    setattr(module, attr, value)  # an existing buffer's name: stays a buffer, persistence kept
