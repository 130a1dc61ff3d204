"""``int8``: symmetric absmax int8 per (head, token) vector, codes entropy-coded.

Each vector x of head_dim values gets ``scale = max|x| / 127`` rounded *up* to the scale dtype,
and codes ``q = round(x / scale)`` in [-127, 127]; decoding gives ``q * scale``. Error bound:
``|x - x̂| <= scale / 2`` per element, plus half an ulp of the block dtype from rounding x̂ to it.

Stream layout (little-endian)::

    13 bytes     header (`seqkv_codecs.base`), magic b"I8", version 1
    1 byte       scale dtype: 0 fp16, 1 fp32
    H*S scales   one per (head, token), C order, fp16 or fp32
    section      rANS symbols q + 127 (alphabet 255), H*S*D of them in C order
"""

from __future__ import annotations

import numpy as np

from seqkv_codecs.base import Codec
from seqkv_codecs.errors import CorruptStreamError
from seqkv_codecs.kvblock import KVBlock
from seqkv_codecs.pervector._lossy import (
    SCALE_DTYPES,
    check_scale_dtype,
    finite_float32,
    round_up,
)
from seqkv_codecs.pervector._symbols import pack_symbols, unpack_symbols

_LEVELS = 127


class Int8Codec(Codec):
    """Per-vector symmetric int8; ``scale_dtype`` ("fp16" or "fp32") sets how scales are kept."""

    codec_id = "int8"
    description = "symmetric absmax int8 per (head, token) vector; |x - x̂| <= scale/2 per element"
    lossless = False
    typical_bits_per_component = 7.3  # bf16 KV of SmolLM2-135M
    stream_magic = b"I8"

    def __init__(self, scale_dtype: str = "fp16") -> None:
        check_scale_dtype(scale_dtype)
        self.scale_dtype = scale_dtype

    def encode(self, block: KVBlock) -> bytes:
        x = finite_float32(block, self.codec_id).astype(np.float64)
        sdt = SCALE_DTYPES[self.scale_dtype]
        scale = round_up(
            np.abs(x).max(axis=2, initial=0.0) / _LEVELS, sdt, "int8 scale (use scale_dtype='fp32')"
        )
        s = scale.astype(np.float64)[..., None]
        q = np.rint(np.divide(x, s, out=np.zeros_like(x), where=s > 0)).astype(np.int16)
        return b"".join(
            (
                self._header(block),
                bytes([list(SCALE_DTYPES).index(self.scale_dtype)]),
                scale.tobytes(),
                pack_symbols((q + _LEVELS).astype(np.uint8), 2 * _LEVELS + 1),
            )
        )

    def decode(self, data: bytes | memoryview) -> KVBlock:
        reader, head = self._open(data)
        heads, seq_len, head_dim = head.shape
        (code,) = reader.unpack("<B")
        if code >= len(SCALE_DTYPES):
            raise CorruptStreamError(f"int8 stream has unknown scale dtype code {code}")
        sdt = list(SCALE_DTYPES.values())[code]
        scale = reader.array(sdt.str, heads * seq_len).astype(np.float32)
        if not np.isfinite(scale).all() or (scale < 0).any():
            raise CorruptStreamError("int8 stream holds a negative or non-finite scale")
        n = heads * seq_len * head_dim
        sym = unpack_symbols(reader, n, 2 * _LEVELS + 1, "int8 codes")
        reader.finish()
        q = sym.astype(np.float32).reshape(head.shape) - _LEVELS
        return KVBlock.from_float32(q * scale.reshape(heads, seq_len, 1), head.dtype, head.kind)
