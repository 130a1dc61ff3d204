"""The widths a checkpoint stores a weight matrix in, and what fp32 value each element means.

A weight is held in the bytes its checkpoint has: fp32, bf16 or fp16 elements, or GGUF
blocks (a scale or two and small integers per 32 or 256 elements). Every computation that
needs a weight's values — the portable definition's integers, an embedding row, the fp32
model an ordinary run uses, the fingerprint — takes them from one definition: **the fp32
value transformers gives that element when it loads the checkpoint in float32**. For the
float kinds that is the exact widening; for GGUF blocks it is gguf-py's `dequantize`, which
transformers' GGUF loader calls (its arithmetic is fp32, and every product in it is exact, so
each element is one correctly rounded fp32 operation at most: `blocks.md` in docs/NUMERICS.md).

`reference_fp32` is that definition, in numpy; the native decoders (`jitted_decode`) compute
the same bits and are checked against it (tests, and the canary on every load).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Kind:
    """One storage width: elements per block, bytes per block, and its GGUF type (if any)."""

    name: str
    block: int  # elements per block (1 for plain floats)
    block_bytes: int
    gguf_type: int | None  # gguf.GGMLQuantizationType value; None: not a GGUF block type
    numpy: str  # dtype of the stored array: uint8 rows of blocks, or the float's bit pattern
    halves: tuple[int, ...] = ()  # byte offsets of the block's fp16 scales (GGUF layouts)

    def row_bytes(self, k: int) -> int:
        """Bytes of one row of ``k`` elements."""
        if k % self.block:
            raise ValueError(f"{self.name} rows hold a multiple of {self.block} elements, not {k}")
        return k // self.block * self.block_bytes

    def elements(self, stored_columns: int) -> int:
        """Elements per row of a stored array with ``stored_columns`` columns (`stored_array`:
        bytes for block kinds, one column an element for floats)."""
        if self.numpy != "uint8":
            return stored_columns
        return stored_columns // self.block_bytes * self.block

    def bytes_per_element(self) -> float:
        return self.block_bytes / self.block


# The kinds a weight is held in. GGUF types outside this table (the IQ and ternary types)
# are dequantized when loaded and held as fp32 (`gguf_file`): they cost memory, not bits.
KINDS: dict[str, Kind] = {
    k.name: k
    for k in (
        Kind("f32", 1, 4, 0, "float32"),
        Kind("f16", 1, 2, 1, "uint16"),
        Kind("bf16", 1, 2, 30, "uint16"),
        Kind("q4_0", 32, 18, 2, "uint8", (0,)),
        Kind("q4_1", 32, 20, 3, "uint8", (0, 2)),
        Kind("q5_0", 32, 22, 6, "uint8", (0,)),
        Kind("q5_1", 32, 24, 7, "uint8", (0, 2)),
        Kind("q8_0", 32, 34, 8, "uint8", (0,)),
        Kind("q2_k", 256, 84, 10, "uint8", (80, 82)),
        Kind("q3_k", 256, 110, 11, "uint8", (108,)),
        Kind("q4_k", 256, 144, 12, "uint8", (0, 2)),
        Kind("q5_k", 256, 176, 13, "uint8", (0, 2)),
        Kind("q6_k", 256, 210, 14, "uint8", (208,)),
    )
}
BY_GGUF_TYPE = {k.gguf_type: k for k in KINDS.values() if k.gguf_type is not None}


def stored_array(kind: Kind, data: np.ndarray) -> np.ndarray:
    """``data`` (rows of one weight matrix) as the array a kind keeps: a C-contiguous 2-D
    array of the kind's numpy dtype (float bit patterns viewed, never converted)."""
    a = np.ascontiguousarray(data)
    if kind.name in ("f16", "bf16"):
        a = a.view(np.uint16)
    return a.view(np.dtype(kind.numpy)).reshape(a.shape[0], -1)


def reference_fp32(kind: Kind, raw: np.ndarray) -> np.ndarray:
    """The fp32 values of rows ``raw`` (2-D, as `stored_array` keeps them): the definition."""
    if kind.name == "f32":
        return raw
    if kind.name == "f16":
        return raw.view(np.float16).astype(np.float32)
    if kind.name == "bf16":
        return (raw.astype(np.uint32) << 16).view(np.float32)
    from gguf import GGMLQuantizationType, dequantize

    return dequantize(raw, GGMLQuantizationType(kind.gguf_type))
