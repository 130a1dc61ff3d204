"""``turbo3`` / ``turbo4``: TurboQuant-class rotation + Lloyd-Max scalar quantization.

Each (head, token) vector x is rotated by a seeded random rotation R (`_rotation`), normalised
to ``z = sqrt(d) * R x / ||x||`` (coordinates close to N(0, 1)), and each coordinate is replaced
by the index of its nearest Lloyd-Max centroid for N(0, 1) (`_lloydmax`). Decoding gives
``||x|| / sqrt(d) * R^T c[idx]``. Error bound (in expectation, not per element): the relative MSE
``E||x - x̂||^2 / ||x||^2`` is the Lloyd-Max distortion, 0.0345 for 3 bits and 0.0095 for 4.

``qjl=True`` adds TurboQuant's 1-bit QJL residual: the signs of ``S r`` for the residual
``r = z - c[idx]`` and a seeded Gaussian matrix S, plus ``||r||``; decoding adds the unbiased
estimate ``sqrt(pi/2) / d * ||r|| * S^T sign(S r)``, which makes inner products with x̂ unbiased
at the price of a larger MSE.

Encoding is deterministic. For power-of-two head_dim without QJL it uses only numpy's
elementwise arithmetic and fixed-order reductions, so streams are identical across machines;
the QR rotation (other head_dim) and the QJL projection go through BLAS, whose last bits may
differ between builds.

Stream layout (little-endian)::

    13 bytes  header (`seqkv_codecs.base`), magic b"TQ", version 1
    1 byte    bits (3 or 4)
    1 byte    flags: bit 0 QJL residual present, bit 1 norms are fp32 (else fp16)
    8 bytes   seed (uint64)
    H*S       vector norms, fp16 or fp32, C order over (head, token)
    section   rANS centroid indices (alphabet 2**bits), H*S*D in C order of the rotated coordinates
    if QJL:   H*S residual norms (fp16), then a rANS section of H*S*D sign bits (alphabet 2)
"""

from __future__ import annotations

import math

import numpy as np

from seqkv_codecs.base import Codec
from seqkv_codecs.errors import CodecError, CorruptStreamError
from seqkv_codecs.kvblock import KVBlock
from seqkv_codecs.pervector._lloydmax import centroids
from seqkv_codecs.pervector._lossy import SCALE_DTYPES, check_scale_dtype, finite_float32
from seqkv_codecs.pervector._rotation import MAX_DENSE_DIM, Rotation
from seqkv_codecs.pervector._symbols import pack_symbols, unpack_symbols

_F16 = np.dtype("<f2")


def _qjl_matrix(dim: int, seed: int) -> np.ndarray:
    if dim > MAX_DENSE_DIM:  # d**2 Gaussians: refused like a dense rotation
        raise CodecError(f"QJL needs head_dim <= {MAX_DENSE_DIM}, got {dim}")
    return np.random.default_rng([seed, dim, 1]).standard_normal((dim, dim))


def _store(values: np.ndarray, dtype: np.dtype, what: str) -> np.ndarray:
    with np.errstate(over="ignore"):
        out = values.astype(dtype)
    if not np.isfinite(out).all():
        raise CodecError(f"{what} exceeds the {dtype.name} range; use norm_dtype='fp32'")
    return out


class _TurboCodec(Codec):
    """Shared implementation; subclasses fix ``bits``."""

    bits: int
    lossless = False
    stream_magic = b"TQ"

    def __init__(self, seed: int = 0, norm_dtype: str = "fp16", qjl: bool = False) -> None:
        if not 0 <= seed < 2**64:
            raise ValueError(f"seed must be in [0, 2**64), got {seed}")
        check_scale_dtype(norm_dtype)
        self.seed = int(seed)
        self.norm_dtype = norm_dtype
        self.qjl = bool(qjl)

    def encode(self, block: KVBlock) -> bytes:
        x = finite_float32(block, self.codec_id).astype(np.float64)
        d = block.shape[2]
        norm = np.sqrt(np.square(x).sum(axis=2))
        stored = _store(norm, SCALE_DTYPES[self.norm_dtype], f"{self.codec_id} vector norm")
        inv = np.divide(math.sqrt(d), norm, out=np.zeros_like(norm), where=norm > 0)
        z = Rotation(d, self.seed).apply(x) * inv[..., None]
        table = centroids(self.bits).astype(np.float64)
        idx = np.searchsorted((table[1:] + table[:-1]) / 2, z).astype(np.uint8)
        flags = int(self.qjl) | (2 if self.norm_dtype == "fp32" else 0)
        parts = [
            self._header(block),
            np.array([self.bits, flags], "<u1").tobytes(),
            np.array([self.seed], "<u8").tobytes(),
            stored.tobytes(),
            pack_symbols(idx, 2**self.bits),
        ]
        if self.qjl:
            r = z - table[idx]
            gamma = np.sqrt(np.square(r).sum(axis=2)).astype(_F16)  # < 4 sqrt(d): fits fp16
            signs = (r @ _qjl_matrix(d, self.seed).T >= 0).astype(np.uint8)
            parts += [gamma.tobytes(), pack_symbols(signs, 2)]
        return b"".join(parts)

    def decode(self, data: bytes | memoryview) -> KVBlock:
        reader, head = self._open(data)
        heads, seq_len, d = head.shape
        bits, flags, seed = reader.unpack("<BBQ")
        if bits not in (3, 4) or flags > 3:
            raise CorruptStreamError(f"{self.codec_id} stream has bad parameters")
        dense = d & (d - 1) != 0 or flags & 1
        if dense and d > MAX_DENSE_DIM:  # refused before a single index is decoded
            raise CorruptStreamError(
                f"{self.codec_id} stream declares head_dim {d}, over {MAX_DENSE_DIM} for a "
                "dense rotation or QJL matrix"
            )
        norm_dt = SCALE_DTYPES["fp32" if flags & 2 else "fp16"]
        norm = reader.array(norm_dt.str, heads * seq_len).astype(np.float64)
        n = heads * seq_len * d
        idx = unpack_symbols(reader, n, 2**bits, f"{self.codec_id} indices")
        z = centroids(bits).astype(np.float64)[idx].reshape(head.shape)
        if flags & 1:
            gamma = reader.array(_F16.str, heads * seq_len).astype(np.float64)
            signs = unpack_symbols(reader, n, 2, f"{self.codec_id} QJL signs")
            pm = signs.reshape(head.shape).astype(np.float64) * 2 - 1
            scale = math.sqrt(math.pi / 2) / max(d, 1) * gamma.reshape(heads, seq_len, 1)
            z = z + scale * (pm @ _qjl_matrix(d, seed))
        reader.finish()
        if not np.isfinite(norm).all() or (norm < 0).any():
            raise CorruptStreamError(f"{self.codec_id} stream holds a bad vector norm")
        x = Rotation(d, seed).invert(z) * (norm.reshape(heads, seq_len, 1) / math.sqrt(max(d, 1)))
        return KVBlock.from_float32(x.astype(np.float32), head.dtype, head.kind)


class Turbo3Codec(_TurboCodec):
    """3-bit TurboQuant-class codec (about 3.1 bits per component with fp16 norms)."""

    codec_id = "turbo3"
    description = "rotation + 3-bit Lloyd-Max per coordinate; relative MSE ~0.0345 (Gaussian)"
    bits = 3
    typical_bits_per_component = 3.1


class Turbo4Codec(_TurboCodec):
    """4-bit TurboQuant-class codec (about 4.1 bits per component with fp16 norms)."""

    codec_id = "turbo4"
    description = "rotation + 4-bit Lloyd-Max per coordinate; relative MSE ~0.0095 (Gaussian)"
    bits = 4
    typical_bits_per_component = 4.1
