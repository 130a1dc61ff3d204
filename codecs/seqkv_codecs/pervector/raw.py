"""``raw``: the captured bits as they are — the 1.0x baseline every ratio is measured against.

Stream layout (little-endian)::

    13 bytes  header (`seqkv_codecs.base`), magic b"RW", version 1
    N * w     the elements in C order (heads, tokens, channels): w = 2 for bf16 bit patterns and
              fp16, 4 for fp32; N = num_kv_heads * seq_len * head_dim

Nothing is entropy-coded: this is the reference, and the fastest path to bytes.
"""

from __future__ import annotations

import math

import numpy as np

from seqkv_codecs.base import Codec
from seqkv_codecs.kvblock import STORAGE_DTYPES, KVBlock


class RawCodec(Codec):
    """Stores the captured bits unchanged (bit-exact, NaN payloads and -0.0 included)."""

    codec_id = "raw"
    description = "captured bits unchanged (bf16/fp16/fp32), lossless, 1.0x"
    lossless = True
    typical_bits_per_component = None  # the element width itself: 16 or 32
    stream_magic = b"RW"

    def encode(self, block: KVBlock) -> bytes:
        little = block.data.astype(block.data.dtype.newbyteorder("<"), copy=False)
        return self._header(block) + np.ascontiguousarray(little).tobytes()

    def decode(self, data: bytes | memoryview) -> KVBlock:
        reader, head = self._open(data)
        dtype = STORAGE_DTYPES[head.dtype].newbyteorder("<")
        values = reader.array(dtype.str, math.prod(head.shape))
        reader.finish()
        native = values.astype(STORAGE_DTYPES[head.dtype], copy=False)
        return KVBlock(native.reshape(head.shape), head.dtype, head.kind)
