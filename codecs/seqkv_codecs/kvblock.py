"""`KVBlock`: one layer's keys or values of one session, the unit every KV codec works on.

numpy has no bfloat16, so bf16 blocks carry the raw uint16 bit pattern; that keeps the captured
bits exact (a detour through float32 and back is lossless, but NaN payloads and rounding are
only guaranteed when the bits are never touched).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

#: storage dtype of each supported element type
STORAGE_DTYPES: dict[str, np.dtype] = {
    "bf16": np.dtype(np.uint16),
    "fp16": np.dtype(np.float16),
    "fp32": np.dtype(np.float32),
}
KINDS = ("key", "value")

_BF16_QUIET_NAN = np.uint16(0x7FC0)


def float32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round float32 to bf16 bits, round-to-nearest-even, exactly like torch `.to(torch.bfloat16)`.

    Every NaN becomes the quiet NaN 0x7FC0, as torch's scalar conversion does (its vectorised CPU
    kernels write 0xFFFF instead, so torch itself only agrees on "it is a NaN"); inf stays inf and
    values past the largest bf16 round to inf.
    """
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    bias = ((u >> np.uint32(16)) & np.uint32(1)) + np.uint32(0x7FFF)
    bits = ((u + bias) >> np.uint32(16)).astype(np.uint16)
    bits[np.isnan(x)] = _BF16_QUIET_NAN
    return bits


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """Widen bf16 bit patterns to float32 exactly (bf16 is the top half of a float32)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


@dataclass(frozen=True, eq=False)
class KVBlock:
    """Keys or values of one layer of one session.

    Parameters
    ----------
    data : np.ndarray
        Shape ``(num_kv_heads, seq_len, head_dim)``; uint16 bit patterns for ``"bf16"``,
        float16 for ``"fp16"``, float32 for ``"fp32"``.
    dtype : str
        ``"bf16"``, ``"fp16"`` or ``"fp32"``: the element type as captured.
    kind : str
        ``"key"`` or ``"value"``: codecs may model the two differently (KIVI does).

    Equality compares the raw bits, so NaN == NaN and 0.0 != -0.0, as a lossless codec promises.
    """

    data: np.ndarray
    dtype: str
    kind: str

    __hash__: ClassVar[None] = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.dtype not in STORAGE_DTYPES:
            raise ValueError(
                f"KVBlock dtype {self.dtype!r} is not supported; use one of {list(STORAGE_DTYPES)}"
            )
        if self.kind not in KINDS:
            raise ValueError(f"KVBlock kind {self.kind!r} is not supported; use 'key' or 'value'")
        if not isinstance(self.data, np.ndarray):
            raise ValueError(f"KVBlock data must be a numpy array, got {type(self.data).__name__}")
        want = STORAGE_DTYPES[self.dtype]
        if self.data.dtype != want:
            hint = " (bf16 is stored as its raw uint16 bit pattern)" if self.dtype == "bf16" else ""
            raise ValueError(
                f"KVBlock data for dtype {self.dtype!r} must be {want}, got {self.data.dtype}{hint}"
            )
        if self.data.ndim != 3 or self.data.shape[0] == 0 or self.data.shape[2] == 0:
            raise ValueError(
                "KVBlock data must have shape (num_kv_heads, seq_len, head_dim) with at least "
                f"one head and one channel, got {self.data.shape}"
            )

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(num_kv_heads, seq_len, head_dim)``."""
        return self.data.shape  # type: ignore[return-value]

    @property
    def nbytes(self) -> int:
        """Size of the captured bits: the baseline every compression ratio divides."""
        return int(self.data.nbytes)

    @property
    def num_components(self) -> int:
        """Number of scalars: the denominator of bits per component."""
        return int(self.data.size)

    def to_float32(self) -> np.ndarray:
        """The values as float32 (exact for every dtype)."""
        if self.dtype == "bf16":
            return bf16_bits_to_float32(self.data)
        return self.data.astype(np.float32)

    def bits(self) -> np.ndarray:
        """The raw bit patterns as unsigned integers (uint16 or uint32)."""
        return self.data.view(np.uint32 if self.dtype == "fp32" else np.uint16)

    @classmethod
    def from_float32(cls, x: np.ndarray, dtype: str, kind: str) -> KVBlock:
        """Round float32 values to ``dtype`` (round-to-nearest-even, as torch does)."""
        x = np.asarray(x, dtype=np.float32)
        if dtype == "bf16":
            data = float32_to_bf16_bits(x)
        elif dtype in STORAGE_DTYPES:
            data = x.astype(STORAGE_DTYPES[dtype])
        else:
            data = x  # __post_init__ names the bad dtype
        return cls(np.ascontiguousarray(data), dtype, kind)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, KVBlock):
            return NotImplemented
        return (
            self.dtype == other.dtype
            and self.kind == other.kind
            and self.data.shape == other.data.shape
            and np.array_equal(self.bits(), other.bits())
        )

    def __repr__(self) -> str:
        return f"KVBlock(shape={self.data.shape}, dtype={self.dtype!r}, kind={self.kind!r})"
