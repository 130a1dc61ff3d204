"""Helpers shared by the lossy per-vector codecs: input checks and directed fp16 rounding.

Scales and minima are rounded *outward* (minimum down, scale up) when they are stored in fp16,
so the quantization grid still covers every input and the stated error bound holds with the
stored, rounded parameters rather than only with the exact ones.
"""

from __future__ import annotations

import numpy as np

from seqkv_codecs.errors import CodecError
from seqkv_codecs.kvblock import KVBlock

FP16_MAX = float(np.finfo(np.float16).max)
SCALE_DTYPES = {"fp16": np.dtype("<f2"), "fp32": np.dtype("<f4")}


def finite_float32(block: KVBlock, codec_id: str) -> np.ndarray:
    """The block as float32; a lossy codec has no representation for NaN or inf."""
    x = block.to_float32()
    if not np.isfinite(x).all():
        raise CodecError(
            f"codec {codec_id!r} cannot encode NaN or inf values; use 'lossless' or 'raw'"
        )
    return x


def round_up(values: np.ndarray, dtype: np.dtype, what: str) -> np.ndarray:
    """Smallest ``dtype`` numbers >= ``values`` (float64 in); refuses overflow to inf."""
    with np.errstate(over="ignore"):
        out = values.astype(dtype)
    low = out.astype(np.float64) < values
    out[low] = np.nextafter(out[low], dtype.type(np.inf))
    if not np.isfinite(out).all():
        raise CodecError(f"{what} exceeds the {dtype.name} range")
    return out


def round_down(values: np.ndarray, dtype: np.dtype, what: str) -> np.ndarray:
    """Largest ``dtype`` numbers <= ``values`` (float64 in); refuses overflow to -inf."""
    with np.errstate(over="ignore"):
        out = values.astype(dtype)
    high = out.astype(np.float64) > values
    out[high] = np.nextafter(out[high], dtype.type(-np.inf))
    if not np.isfinite(out).all():
        raise CodecError(f"{what} exceeds the {dtype.name} range")
    return out


def check_scale_dtype(scale_dtype: str) -> None:
    """Config validation shared by the codecs that store scales."""
    if scale_dtype not in SCALE_DTYPES:
        raise ValueError(f"scale_dtype must be one of {list(SCALE_DTYPES)}, got {scale_dtype!r}")
