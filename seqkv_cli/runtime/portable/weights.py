"""The model's weights as the portable definition multiplies them: quantized rows, made once.

A parameter's rows are quantized to a product's right-operand bits on first use and cached
(weights never change in inference); a native step kernel reads the same integers split to
three bytes a weight.
"""

from __future__ import annotations

import torch

from seqkv_cli.runtime.portable import exact, kernels


class QuantizedWeight:
    """One parameter's quantized rows: the integers as fp64 (what a BLAS product multiplies),
    their exponents, and — made on a native kernel's first use (a step), CPU only — the same
    integers split to 3 bytes a weight (`kernels.split_weights`)."""

    def __init__(self, f64: torch.Tensor, e: torch.Tensor, native: bool) -> None:
        self.f64, self.e, self.native = f64, e, native
        self._ints = None

    @classmethod
    def of(cls, w: torch.Tensor, bits: int) -> QuantizedWeight:
        """``w``'s rows quantized to ``bits`` (`exact.quantize_rows`)."""
        xq, e = exact.quantize_rows(w, bits)
        # The kernel takes one (N, K) matrix of |integers| <= 2**23; stacked (expert) weights
        # and wider integers keep the BLAS product.
        return cls(xq.contiguous(), e, w.device.type == "cpu" and w.dim() == 2 and bits <= 23)

    @classmethod
    def stacked(cls, parts: list[QuantizedWeight]) -> QuantizedWeight:
        """The rows of several weights over the same input as one (a row's integers depend on
        that row alone, so one product gives each part's bits): one pass over x for q, k, v."""
        return cls(
            torch.cat([p.f64 for p in parts]),
            torch.cat([p.e for p in parts]),
            all(p.native for p in parts),
        )

    @property
    def ints(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(hi, lo) for the native kernel, or None where it cannot take this weight."""
        if not self.native or not kernels.enabled():
            return None
        if self._ints is None:
            self._ints = kernels.split_weights(self.f64)
        return self._ints

    def product(self, x: torch.Tensor, bits: int, form: int) -> torch.Tensor:
        """Exact fp64 ``x @ Wᵀ`` in the portable definition (`exact.fixed_product`'s bits)."""
        if self.native and exact.native_product(x, form):
            return exact.kernel_product(x, bits, self.ints, self.e, form)
        return exact.fixed_product(x, bits, self.f64, self.e, form)


class WeightCache:
    """Quantized rows of the model's parameters, made once (they never change in inference)."""

    def __init__(self, model) -> None:
        self._owners = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self._owners |= {b.untyped_storage().data_ptr() for b in model.buffers()}
        self._cache: dict[tuple, QuantizedWeight] = {}

    def rows(self, w: torch.Tensor, bits: int) -> QuantizedWeight:
        """``w``'s rows quantized to ``bits``, cached when ``w`` is (a view of) a parameter."""
        if w.untyped_storage().data_ptr() not in self._owners:
            return QuantizedWeight.of(w, bits)
        key = self._key(w, bits)
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = QuantizedWeight.of(w, bits)
        return hit

    def stacked(self, ws: list[torch.Tensor], bits: int) -> QuantizedWeight:
        """`QuantizedWeight.stacked` of parameters, cached; their single entries are dropped
        (the stacked copy serves every call that reads them together)."""
        key = ("stacked", *(self._key(w, bits) for w in ws))
        hit = self._cache.get(key)
        if hit is None:
            singles = [self._cache.pop(self._key(w, bits), None) for w in ws]
            if all(singles):  # quantized already (the probe's reference run): reuse them
                hit = QuantizedWeight.stacked(singles)
            else:  # rows quantize alone: the stacked rows' integers are the singles'
                hit = QuantizedWeight.of(torch.cat(ws), bits)
            self._cache[key] = hit
        return hit

    @staticmethod
    def _key(w: torch.Tensor, bits: int) -> tuple:
        ptr = w.untyped_storage().data_ptr()
        return (ptr, w.storage_offset(), tuple(w.shape), tuple(w.stride()), bits)
