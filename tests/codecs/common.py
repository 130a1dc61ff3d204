"""Checks every KV codec goes through, and the synthetic KV they run on (numcodecs-style).

The real KV sample is local scratch, so tests build blocks with its known structure: channels
of very different scales, a few outlier channels with a large offset (keys), and tokens that
correlate with the previous token.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from seqkv_codecs.base import Codec
from seqkv_codecs.errors import CorruptStreamError
from seqkv_codecs.kvblock import KVBlock
from seqkv_codecs.registry import get_codec

DTYPES = ("bf16", "fp16", "fp32")
KINDS = ("key", "value")


def make_kv(
    heads: int = 2, seq_len: int = 40, head_dim: int = 16, seed: int = 0, kind: str = "key"
) -> np.ndarray:
    """float32 KV-like data of shape (heads, seq_len, head_dim)."""
    rng = np.random.default_rng(seed)
    scale = np.exp(rng.normal(0.0, 1.0, (heads, 1, head_dim)))
    offset = np.zeros((heads, 1, head_dim))
    if kind == "key":  # a few outlier channels sit far from zero
        outliers = rng.random((heads, 1, head_dim)) < 0.1
        offset = np.where(outliers, rng.normal(0.0, 8.0, offset.shape), 0.0)
    z = rng.standard_normal((heads, seq_len, head_dim))
    for t in range(1, seq_len):  # AR(1): neighbouring tokens resemble each other
        z[:, t] = 0.6 * z[:, t - 1] + 0.8 * z[:, t]
    return (offset + scale * z).astype(np.float32)


def make_block(dtype: str, kind: str, **kwargs: int) -> KVBlock:
    """`make_kv` rounded to ``dtype``."""
    return KVBlock.from_float32(make_kv(kind=kind, **kwargs), dtype, kind)


def special_block(dtype: str, kind: str = "value") -> KVBlock:
    """Every awkward bit pattern: NaNs with payloads and signs, ±inf, ±0, subnormals, extremes."""
    block = make_block(dtype, kind, heads=2, seq_len=12, head_dim=8, seed=7)
    bits = block.bits().copy()
    width = 32 if dtype == "fp32" else 16
    e_bits = {"bf16": 8, "fp16": 5, "fp32": 8}[dtype]
    m_bits = width - 1 - e_bits
    sign, exp_all = 1 << (width - 1), ((1 << e_bits) - 1) << m_bits
    specials = [
        exp_all | 1,  # signalling NaN payload
        sign | exp_all | (1 << (m_bits - 1)) | 5,  # negative quiet NaN with payload
        exp_all,  # +inf
        sign | exp_all,  # -inf
        0,  # +0.0
        sign,  # -0.0
        1,  # smallest subnormal
        sign | ((1 << m_bits) - 1),  # largest negative subnormal
        exp_all - 1,  # largest finite
        sign | (exp_all - 1),  # most negative finite
    ]
    flat = bits.reshape(-1)
    flat[3 : 3 + len(specials)] = specials
    flat[-len(specials) :] = specials[::-1]
    storage = bits.view(block.data.dtype) if dtype != "bf16" else bits
    return KVBlock(storage, dtype, kind)


def check_config(codec: Codec) -> None:
    """Config is JSON-safe, names the codec and rebuilds an equal codec."""
    config = codec.get_config()
    assert config["id"] == codec.codec_id
    assert json.loads(json.dumps(config)) == config
    again = type(codec).from_config(config)
    assert again == codec
    assert get_codec(config) == codec
    assert repr(again) == repr(codec)
    assert isinstance(codec.description, str) and "\n" not in codec.description


def check_roundtrip(codec: Codec, block: KVBlock) -> tuple[bytes, KVBlock]:
    """Encode twice (same bytes), decode from bytes and memoryview; shape/dtype/kind kept."""
    encoded = codec.encode(block)
    assert isinstance(encoded, bytes)
    assert codec.encode(block) == encoded, "encoding is not deterministic"
    decoded = codec.decode(encoded)
    assert isinstance(decoded, KVBlock)
    assert (decoded.shape, decoded.dtype, decoded.kind) == (block.shape, block.dtype, block.kind)
    assert decoded.data.dtype == block.data.dtype
    assert codec.decode(memoryview(encoded)) == decoded
    assert type(codec)().decode(encoded) == decoded, "the stream must carry its own parameters"
    return encoded, decoded


def check_lossless(codec: Codec, block: KVBlock) -> None:
    """Bit-exact round trip (compares raw bits, so NaN payloads and -0.0 count)."""
    _, decoded = check_roundtrip(codec, block)
    np.testing.assert_array_equal(decoded.bits(), block.bits())


def check_corrupt(codec: Codec, encoded: bytes) -> None:
    """Truncation anywhere, a trailing byte and a foreign magic all raise CorruptStreamError."""
    cuts = sorted({0, 1, 12, 13, len(encoded) // 2, len(encoded) - 1} - {len(encoded)})
    for cut in cuts:
        with pytest.raises(CorruptStreamError):
            codec.decode(encoded[:cut])
    with pytest.raises(CorruptStreamError):
        codec.decode(encoded + b"\0")
    with pytest.raises(CorruptStreamError):
        codec.decode(b"ZZ" + encoded[2:])


def half_ulp(x: np.ndarray, dtype: str) -> np.ndarray:
    """Half the spacing of ``dtype`` numbers at |x|: the error of rounding to ``dtype``."""
    a = np.abs(np.asarray(x, dtype=np.float32))
    if dtype == "fp16":
        return np.spacing(a.astype(np.float16)).astype(np.float64) / 2
    spacing = np.spacing(a).astype(np.float64)
    return spacing * (2.0**16 if dtype == "bf16" else 1.0) / 2
