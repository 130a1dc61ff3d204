"""The model's weights as the portable definition multiplies them: integers made where they
are multiplied, from the one copy the checkpoint's width allows.

A weight's right-operand integers are ``rint(w · 2**(bits - E))`` for its fp32 values w and
its row's peak exponent E (`exact.quantize_rows`). On the CPU they are never kept: a step's
native kernel makes each row's integers from the stored bytes (`checkpoint.StoredTensor`:
fp32, bf16, fp16 or GGUF blocks) as it multiplies them, and a prefill's BLAS product takes
them a tile of rows at a time (a few MB, transient). The only thing kept per weight is E,
one integer a row. Where the native kernels do not run (a GPU, or the reference switch) the
integers of each weight are made once from its fp32 values and kept, as the torch reference
always did: the same bits, more memory.
"""

from __future__ import annotations

import numpy as np
import torch

from seqkv_cli.runtime.checkpoint import StoredTensor, WeightStore
from seqkv_cli.runtime.portable import exact, kernels

TILE_ELEMENTS = 1 << 20  # weight integers made at a time for a BLAS product (8 MB of fp64)


class DenseRows:
    """A right operand's rows quantized whole (fp64 integers and row exponents): the torch
    reference, and any operand that is not a stored weight."""

    def __init__(self, w: torch.Tensor, bits: int) -> None:
        self.wq, self.e = exact.quantize_rows(w, bits)

    def product(self, x: torch.Tensor, bits: int, form: int) -> torch.Tensor:
        """Exact fp64 ``x @ Wᵀ`` in the portable definition (`exact.fixed_product`)."""
        return exact.fixed_product(x, bits, self.wq, self.e, form)


class StoredRows:
    """The rows of one or more stored weights over the same input, as one right operand (a
    row's integers depend on that row alone, so q, k and v stacked give each its own bits)."""

    def __init__(self, parts: list[StoredTensor], cache: WeightCache) -> None:
        self.parts, self.cache = parts, cache
        self.n = sum(p.shape[0] for p in parts)

    def product(self, x: torch.Tensor, bits: int, form: int) -> torch.Tensor:
        """Exact fp64 ``x @ Wᵀ`` for x (.., M, K): `exact.fixed_product`'s bits."""
        if not kernels.usable(x):
            return self.cache.dense(self.parts, bits, x.device).product(x, bits, form)
        lead, k = x.shape[:-1], x.shape[-1]
        rows = x.reshape(-1, k)
        if kernels.native_product(rows, form):
            out = torch.cat([self._step(rows, bits, form, p) for p in self.parts], dim=-1)
        else:
            out = self._tiled(rows, bits, form)
        return out.view(*lead, self.n)

    def _step(self, rows, bits: int, form: int, part: StoredTensor) -> torch.Tensor:
        self.cache.before_step(part.kind.name, form)  # a set lookup after the first step
        peaks = self.cache.peaks(part)
        if form != exact.PEAK2:
            x = kernels.kernel_input(rows)
            runs = self.cache.runs(part)
            return kernels.stored_step(x, bits, form == exact.L1, part, peaks, bits, runs)
        both, ex = kernels.split_stacked(exact.f64(rows)[None], bits)
        sums = kernels.stored_products(both[0], part, peaks, bits)
        return kernels.combine(sums[None], ex, _exponents(peaks, bits), bits)[0]

    def _tiled(self, rows, bits: int, form: int) -> torch.Tensor:
        """The BLAS product a tile of weight rows at a time: each tile's integers are made,
        multiplied and dropped (the sums are exact, so tiling changes no bit)."""
        two = form == exact.PEAK2
        if two:
            left, ex = kernels.split_stacked(exact.f64(rows)[None], bits)
            left = left[0]
        else:
            left, ex = exact.quantize_left(rows, bits, form)
        out = torch.empty((rows.shape[0], self.n), dtype=torch.float64)
        col = 0
        for part in self.parts:
            peaks = self.cache.peaks(part)
            step = max(1, TILE_ELEMENTS // part.shape[1])
            for a in range(0, part.shape[0], step):
                b = min(part.shape[0], a + step)
                w = kernels.stored_tile(part, a, b, peaks, bits)
                ew = _exponents(peaks[a:b], bits)
                s = torch.matmul(left, w.T)
                s = (
                    kernels.combine(s[None], ex, ew, bits)[0]
                    if two
                    else (kernels.scale_product(s, ex, ew))
                )
                out[:, col + a : col + b] = s
            col += part.shape[0]
        return out


def _exponents(peaks: np.ndarray, bits: int) -> torch.Tensor:
    """The rows' exponents ``e = E - bits`` (`exact.quantize_rows`), int64 (N, 1)."""
    return torch.from_numpy(peaks - bits).view(-1, 1)


class WeightCache:
    """How the portable forward finds the right operand of a product: a stored weight's
    rows (`StoredRows`), or any other tensor quantized (`DenseRows`; cached when it is a
    parameter of the model, since weights never change in inference)."""

    def __init__(self, model, store: WeightStore, before_step=None) -> None:
        self.store = store
        # Called with (stored kind, form) before a step's native product: the model passes
        # the canary's check (the canary builds its own caches, so it cannot be imported here).
        self.before_step = before_step or (lambda kind, form: None)
        self._owners = {p.untyped_storage().data_ptr() for p in model.parameters() if not p.is_meta}
        self._owners |= {b.untyped_storage().data_ptr() for b in model.buffers()}
        self._dense: dict[tuple, DenseRows] = {}
        self._peaks: dict[int, np.ndarray] = {}
        self._runs: dict[int, np.ndarray] = {}

    def stored(self, w: torch.Tensor) -> StoredTensor | None:
        """The stored weight ``w`` is (the module's parameter or a same-shaped view), or None."""
        return self.store.find(w)

    def rows(self, w: torch.Tensor, bits: int) -> StoredRows | DenseRows:
        """``w``'s rows as a product's right operand at ``bits``."""
        held = self.store.find(w)
        if held is not None:
            return StoredRows([held], self)
        if w.untyped_storage().data_ptr() not in self._owners:
            return DenseRows(w, bits)
        key = (w.untyped_storage().data_ptr(), w.storage_offset(), *w.shape, *w.stride(), bits)
        hit = self._dense.get(key)
        if hit is None:
            hit = self._dense[key] = DenseRows(w, bits)
        return hit

    def stacked(self, ws: list[torch.Tensor], bits: int) -> StoredRows | DenseRows:
        """The rows of several weights over the same input as one operand: one pass over x."""
        held = [self.store.find(w) for w in ws]
        if all(h is not None for h in held):
            return StoredRows(held, self)
        return DenseRows(torch.cat(ws), bits)

    def embedding(self, weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``F.embedding(ids, weight)``: a stored weight's rows decoded, any other gathered."""
        held = self.store.find(weight)
        if held is None:
            return torch.nn.functional.embedding(ids, weight)
        return held.gather(ids)

    def peaks(self, part: StoredTensor) -> np.ndarray:
        """A stored weight's row peak exponents (`exact.quantize_rows`' E), made once."""
        hit = self._peaks.get(id(part))
        if hit is None:
            hit = self._peaks[id(part)] = kernels.stored_peaks(part)
        return hit

    def runs(self, part: StoredTensor) -> np.ndarray:
        """A stored weight's run bounds (`kernels.stored_runs`), made once."""
        hit = self._runs.get(id(part))
        if hit is None:
            hit = self._runs[id(part)] = kernels.stored_runs(part)
        return hit

    def dense(self, parts: list[StoredTensor], bits: int, device) -> DenseRows:
        """The reference's operand for stored weights: their fp32 values quantized whole on
        ``device``, made once (the GPU and `SEQKV_PORTABLE_KERNELS=reference` run this)."""
        key = (*map(id, parts), bits, str(device))
        hit = self._dense.get(key)
        if hit is None:
            values = torch.cat([p.fp32_rows() for p in parts]).to(device)
            hit = self._dense[key] = DenseRows(values, bits)
        return hit
