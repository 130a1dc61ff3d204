"""``kivi2`` / ``kivi4``: KIVI-style asymmetric (min + scale) quantization with an fp16 window.

Keys are quantized per channel (a group is ``group_size`` consecutive tokens of one channel),
values per token (a group is ``group_size`` consecutive channels of one token), as KIVI does:
key outliers live in fixed channels, value outliers in tokens. The most recent ``residual``
tokens stay in fp16. Per group the minimum is rounded down and the scale
``(max - min) / (2**bits - 1)`` rounded up to fp16, so every element satisfies
``|x - x̂| <= scale / 2`` (plus half an ulp of the block dtype); the window is x rounded to fp16.

Stream layout (little-endian)::

    13 bytes  header (`seqkv_codecs.base`), magic b"KI", version 1
    1 byte    bits (2 or 4)
    2 bytes   group_size (uint16)
    4 bytes   W = tokens kept in fp16 (uint32); the first S - W tokens are quantized
    section   group minima, fp16, as a `lossless` stream: keys (H, ceil((S-W)/g), D),
              values (H, S-W, ceil(D/g))
    section   group scales, fp16, `lossless` stream of the same shape
    section   rANS codes (alphabet 2**bits), H*(S-W)*D of them: keys in (head, channel, token)
              order, values in (head, token, channel) order
    section   the window, fp16 (H, W, D), as a `lossless` stream
"""

from __future__ import annotations

import numpy as np

from seqkv_codecs.base import Codec
from seqkv_codecs.errors import CodecError, CorruptStreamError
from seqkv_codecs.framing import part
from seqkv_codecs.kvblock import KVBlock
from seqkv_codecs.pervector._lossy import FP16_MAX, finite_float32, round_down, round_up
from seqkv_codecs.pervector._symbols import pack_symbols, unpack_symbols
from seqkv_codecs.pervector.lossless import LosslessCodec

_F16 = np.dtype("<f2")


def _fp16_block(a: np.ndarray, kind: str) -> KVBlock:
    return KVBlock(np.ascontiguousarray(a, dtype=np.float16), "fp16", kind)


class _KiviCodec(Codec):
    """Shared implementation; subclasses fix ``bits``."""

    bits: int
    lossless = False
    stream_magic = b"KI"

    def __init__(self, group_size: int = 32, residual: int = 128) -> None:
        if not 1 <= group_size <= 0xFFFF:
            raise ValueError(f"group_size must be in [1, 65535], got {group_size}")
        if residual < 0:
            raise ValueError(f"residual must be >= 0, got {residual}")
        self.group_size = int(group_size)
        self.residual = int(residual)

    def encode(self, block: KVBlock) -> bytes:
        x = finite_float32(block, self.codec_id).astype(np.float64)
        n_q = max(0, block.shape[1] - self.residual)
        window = x[:, n_q:]
        if np.abs(window).max(initial=0.0) > FP16_MAX:
            raise CodecError(f"{self.codec_id}: a recent-window value exceeds the fp16 range")
        a = x[:, :n_q].transpose(0, 2, 1) if block.kind == "key" else x[:, :n_q]
        g, length = self.group_size, a.shape[2]
        pad = -length % g
        if pad and length:  # repeat the last element: min and max of the group stay the same
            a_pad = np.concatenate([a, np.repeat(a[..., -1:], pad, axis=2)], axis=2)
        else:
            a_pad = a
        groups = a_pad.reshape(*a.shape[:2], -(-length // g), g)
        lo = round_down(groups.min(axis=3), _F16, f"{self.codec_id} minimum")
        span = groups.max(axis=3) - lo.astype(np.float64)
        scale = round_up(span / (2**self.bits - 1), _F16, f"{self.codec_id} scale")
        s = np.repeat(scale.astype(np.float64), g, axis=2)[..., :length]
        m = np.repeat(lo.astype(np.float64), g, axis=2)[..., :length]
        q = np.rint(np.divide(a - m, s, out=np.zeros_like(a), where=s > 0))
        q = np.clip(q, 0, 2**self.bits - 1).astype(np.uint8)
        params = (
            (lo, scale)
            if block.kind == "value"
            else (lo.transpose(0, 2, 1), scale.transpose(0, 2, 1))
        )
        codec = LosslessCodec()
        return b"".join(
            (
                self._header(block),
                np.array([self.bits], "<u1").tobytes(),
                np.array([g], "<u2").tobytes(),
                np.array([block.shape[1] - n_q], "<u4").tobytes(),
                part(codec.encode(_fp16_block(params[0], block.kind))),
                part(codec.encode(_fp16_block(params[1], block.kind))),
                pack_symbols(q, 2**self.bits),
                part(codec.encode(_fp16_block(window, block.kind))),
            )
        )

    def decode(self, data: bytes | memoryview) -> KVBlock:
        reader, head = self._open(data)
        heads, seq_len, head_dim = head.shape
        bits, g, w = reader.unpack("<BHI")
        if bits not in (2, 4) or g == 0 or w > seq_len:
            raise CorruptStreamError(f"{self.codec_id} stream has bad parameters")
        n_q = seq_len - w
        n_groups = -(-(n_q if head.kind == "key" else head_dim) // g)
        shape = (heads, n_groups, head_dim) if head.kind == "key" else (heads, n_q, n_groups)
        lo, scale = (self._nested(reader.part(), shape) for _ in range(2))
        if head.kind == "key":
            lo, scale = lo.transpose(0, 2, 1), scale.transpose(0, 2, 1)
        length = n_q if head.kind == "key" else head_dim
        q_shape = (heads, head_dim, n_q) if head.kind == "key" else (heads, n_q, head_dim)
        q = unpack_symbols(reader, heads * n_q * head_dim, 2**bits, f"{self.codec_id} codes")
        window = self._nested(reader.part(), (heads, w, head_dim))
        reader.finish()
        s = np.repeat(scale, g, axis=2)[..., :length]
        m = np.repeat(lo, g, axis=2)[..., :length]
        a = m + q.reshape(q_shape).astype(np.float32) * s
        if head.kind == "key":
            a = a.transpose(0, 2, 1)
        x = np.concatenate([a, window], axis=1)
        return KVBlock.from_float32(x, head.dtype, head.kind)

    def _nested(self, data: memoryview, shape: tuple[int, int, int]) -> np.ndarray:
        if 0 in shape:  # no groups (all tokens in the window, or an empty window)
            block = LosslessCodec().decode(data)
        else:  # the shape follows from the outer header: refuse before decoding
            try:
                block = LosslessCodec().decode_checked(data, shape, "fp16")
            except CorruptStreamError:
                block = None
        if block is None or block.dtype != "fp16" or block.shape != shape:
            raise CorruptStreamError(f"{self.codec_id} stream holds a parameter block of bad shape")
        a = block.to_float32()
        if not np.isfinite(a).all():
            raise CorruptStreamError(f"{self.codec_id} stream holds a non-finite parameter")
        return a


class Kivi2Codec(_KiviCodec):
    """2-bit KIVI (KIVI's headline setting)."""

    codec_id = "kivi2"
    description = "KIVI 2-bit: keys per-channel, values per-token groups; |x - x̂| <= scale/2"
    bits = 2
    typical_bits_per_component = 4.8  # 512 tokens, 128 of them in the fp16 window


class Kivi4Codec(_KiviCodec):
    """4-bit KIVI."""

    codec_id = "kivi4"
    description = "KIVI 4-bit: keys per-channel, values per-token groups; |x - x̂| <= scale/2"
    bits = 4
    typical_bits_per_component = 6.4  # 512 tokens, 128 of them in the fp16 window
