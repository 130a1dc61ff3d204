"""Split IEEE-style floats into sign, exponent and mantissa fields, and pack mantissas.

The split is a bijection on bit patterns (NaN payloads, inf, -0.0 and subnormals included),
which is what lets the `lossless` codec model each field separately and still restore every
bit.
"""

from __future__ import annotations

import numpy as np

from seqkv_codecs.framing import StreamReader

#: dtype -> (exponent bits, mantissa bits)
FIELDS: dict[str, tuple[int, int]] = {"bf16": (8, 7), "fp16": (5, 10), "fp32": (8, 23)}


def split(bits: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sign, biased exponent and mantissa of raw bit patterns, each as int64."""
    e_bits, m_bits = FIELDS[dtype]
    u = bits.astype(np.int64)
    return u >> (e_bits + m_bits), (u >> m_bits) & ((1 << e_bits) - 1), u & ((1 << m_bits) - 1)


def join(sign: np.ndarray, exponent: np.ndarray, mantissa: np.ndarray, dtype: str) -> np.ndarray:
    """Inverse of `split`: the raw bit patterns as uint16 or uint32."""
    e_bits, m_bits = FIELDS[dtype]
    u = (sign << (e_bits + m_bits)) | (exponent << m_bits) | mantissa
    return u.astype(np.uint32 if dtype == "fp32" else np.uint16)


def pack_mantissa(mantissa: np.ndarray, m_bits: int) -> bytes:
    """Whole low bytes as they are, then the remaining high bits bit-packed (little bit order).

    Mantissas of real KV are close to uniform (measured: modelling them costs more in tables
    than it saves), so they are stored, not entropy-coded.
    """
    m = mantissa.reshape(-1)
    full, rest = divmod(m_bits, 8)
    low = (m & ((1 << (8 * full)) - 1)).astype(f"<u{full}") if full else np.empty(0, np.uint8)
    high = (m >> (8 * full))[:, None] >> np.arange(rest) & 1
    return low.tobytes() + np.packbits(high.astype(np.uint8), bitorder="little").tobytes()


def unpack_mantissa(reader: StreamReader, count: int, m_bits: int) -> np.ndarray:
    """Read ``count`` mantissas written by `pack_mantissa`."""
    full, rest = divmod(m_bits, 8)
    low = reader.array(f"<u{full}", count).astype(np.int64) if full else np.zeros(count, np.int64)
    packed = np.frombuffer(reader.take(-(-count * rest // 8)), dtype=np.uint8)
    bits = np.unpackbits(packed, count=count * rest, bitorder="little").reshape(count, rest)
    high = (bits.astype(np.int64) << np.arange(rest)).sum(axis=1)
    return low | (high << (8 * full))
