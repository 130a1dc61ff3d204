"""``lossless``: float-aware lossless coder for bf16 / fp16 / fp32 KV blocks.

Why not a byte compressor: KV channels have very different magnitudes but each channel is
steady, a channel's sign is often biased (keys), a token's sign and exponent resemble the
previous token's in the same channel, and first-layer values repeat whole vectors whenever a
token repeats. So:

- a vector identical to an earlier one of its head is stored as a reference (`_dedup`);
- every other value is split into fields (`_floatfields`): the sign relative to the channel's
  majority sign, the exponent as ``delta = exponent - ref`` (``ref``: the channel's median
  exponent) and the top mantissa bit form one symbol, coded in 8 contexts: the previous
  token's relative sign and delta class (<= -2, -1, 0, >= 1) in the same (head, channel).
  Deltas outside [-24, 7] are escapes whose exponent follows in a stream of its own;
- the other mantissa bits are stored: measured close to uniform, a table costs more than it
  saves; low bits that are zero throughout the block (bf16 data held as fp16/fp32) are dropped.

Measured on bf16 KV of SmolLM2-135M (512 tokens, 30 layers): see docs/CODEC_STREAMS.md.

Stream layout (little-endian; elements are taken in token-major order (token, head, channel),
the order the decoder rebuilds tokens in; C = number of coded elements, D times the number of
vectors that are not copies)::

    13 bytes      header (`seqkv_codecs.base`), magic b"LL", version 1
    H*D bytes     ref: median biased exponent per (head, channel), uint8
    ceil(H*D/8)   majority sign per (head, channel), bit-packed, little bit order
    1 section     copy flag per (token, head), token-major (rANS, alphabet 2)
    1 section     the ordinal each copy refers to, in order (rANS, alphabet <= 65536)
    8 sections    symbols ``2 * (33 * rel_sign + e) + top_mantissa_bit`` (alphabet 132) with
                  ``e = delta + 24``, or 32 for an escape; section k holds context k:
                  ``4 * previous rel_sign + previous delta class``
    1 section     escaped biased exponents, in order (alphabet 2**E: 256, or 32 for fp16)
    1 byte        Z: low mantissa bits that are zero in every coded element (at most M - 1)
    rest          bits Z .. M-2 of the mantissa of the C coded elements, B = M - 1 - Z bits
                  each: floor(B/8) whole low bytes per element (little-endian), then the
                  remaining B mod 8 high bits of every element bit-packed, little bit order

The context of token t comes from token t-1 in the same (head, channel), copied or not
(token 0 uses context 2, as if the previous token had relative sign 0 and delta 0).
"""

from __future__ import annotations

import numpy as np

from seqkv_codecs.base import Codec
from seqkv_codecs.errors import CorruptStreamError
from seqkv_codecs.kvblock import STORAGE_DTYPES, KVBlock
from seqkv_codecs.pervector._contexts import ContextQueues, pack_by_context
from seqkv_codecs.pervector._dedup import MAX_ORDINAL, find_copies
from seqkv_codecs.pervector._floatfields import (
    FIELDS,
    join,
    pack_mantissa,
    split,
    unpack_mantissa,
)
from seqkv_codecs.pervector._symbols import pack_symbols, unpack_symbols

_LO, _HI = -24, 7  # exponent deltas coded in the window; the rest escape
_ESCAPE = _HI - _LO + 1
_SIGNED = 2 * (_ESCAPE + 1)  # symbols per relative sign
_ALPHABET = 2 * _SIGNED
_CONTEXTS = 8


def _context(rel_sign: np.ndarray, delta: np.ndarray) -> np.ndarray:
    return 4 * rel_sign + np.clip(delta, -2, 1) + 2


def _trailing_zeros(value: int, limit: int) -> int:
    """Low bits that are zero in every mantissa (``limit`` when all are zero): bf16 data held
    as fp16 or fp32 has 3 or 16 of them, and they are not worth storing."""
    value = int(value)
    return limit if value == 0 else min(limit, (value & -value).bit_length() - 1)


def _previous(field: np.ndarray, first: int) -> np.ndarray:
    """The field shifted one token later (token axis first); token 0 sees ``first``."""
    return np.concatenate([np.full_like(field[:1], first), field[:-1]])


class LosslessCodec(Codec):
    """Bit-exact float coder: repeated vectors referenced, sign/exponent modelled, mantissa kept."""

    codec_id = "lossless"
    description = "bit-exact float coder: vector dedup + channel-referenced sign/exponent + rANS"
    lossless = True
    typical_bits_per_component = 10.3  # bf16 KV of SmolLM2-135M; fp16 ~ 13, fp32 ~ 26
    stream_magic = b"LL"

    def encode(self, block: KVBlock) -> bytes:
        e_bits, m_bits = FIELDS[block.dtype]
        bits = block.bits().transpose(1, 0, 2)  # token-major: (S, H, D)
        is_copy, ordinals = find_copies(bits)
        sign, exp, man = split(bits, block.dtype)
        seq_len = block.shape[1]
        if seq_len:
            ref = np.partition(exp, seq_len // 2, axis=0)[seq_len // 2]
        else:
            ref = np.zeros(exp.shape[1:], dtype=np.int64)
        majority = 2 * sign.sum(axis=0) > seq_len
        rel_sign = sign ^ majority
        delta = exp - ref
        e_sym = np.where((delta >= _LO) & (delta <= _HI), delta - _LO, _ESCAPE)
        sym = _SIGNED * rel_sign + 2 * e_sym + (man >> (m_bits - 1))
        context = _context(_previous(rel_sign, 0), _previous(delta, 0))
        coded = np.broadcast_to(~is_copy[:, :, None], bits.shape)
        low = man[coded] & ((1 << (m_bits - 1)) - 1)
        zeros = _trailing_zeros(np.bitwise_or.reduce(low, initial=0), m_bits - 1)
        return b"".join(
            (
                self._header(block),
                ref.astype(np.uint8).tobytes(),
                np.packbits(majority, bitorder="little").tobytes(),
                pack_symbols(is_copy.astype(np.uint8), 2),
                pack_symbols(ordinals, int(ordinals.max(initial=0)) + 1),
                pack_by_context(sym[coded], context[coded], _CONTEXTS, _ALPHABET),
                pack_symbols(exp[coded & (e_sym == _ESCAPE)], 1 << e_bits),
                bytes([zeros]),
                pack_mantissa(low >> zeros, m_bits - 1 - zeros),
            )
        )

    def decode(self, data: bytes | memoryview) -> KVBlock:
        reader, head = self._open(data)
        heads, seq_len, head_dim = head.shape
        e_bits, m_bits = FIELDS[head.dtype]
        ref = reader.array("u1", heads * head_dim).astype(np.int64).reshape(heads, head_dim)
        if ref.max() >= 1 << e_bits:
            raise CorruptStreamError("lossless stream holds a reference exponent out of range")
        packed = np.frombuffer(reader.take(-(-heads * head_dim // 8)), dtype=np.uint8)
        majority = np.unpackbits(packed, count=heads * head_dim, bitorder="little")
        is_copy = unpack_symbols(reader, seq_len * heads, 2, "lossless copy flags") == 1
        n_copies = int(is_copy.sum())
        ordinals = unpack_symbols(reader, n_copies, MAX_ORDINAL, "lossless copy ordinals")
        n = (seq_len * heads - n_copies) * head_dim
        symbols = ContextQueues(reader, _CONTEXTS, n, _ALPHABET, "lossless symbols")
        escaped = unpack_symbols(reader, None, 1 << e_bits, "lossless escapes", max_count=n)
        (zeros,) = reader.unpack("<B")
        if zeros > m_bits - 1:
            raise CorruptStreamError("lossless stream drops more mantissa bits than there are")
        low = unpack_mantissa(reader, n, m_bits - 1 - zeros).reshape(-1, head_dim) << zeros
        reader.finish()

        rows = _Rows(seq_len, heads, head_dim, ref)
        n_copied = n_esc = n_low = 0
        for t, copy_row in enumerate(is_copy.reshape(seq_len, heads)):
            for h in np.flatnonzero(copy_row):
                rows.copy(t, h, int(ordinals[n_copied]))
                n_copied += 1
            new = np.flatnonzero(~copy_row)
            sym = symbols.take(rows.context[new].reshape(-1)).reshape(new.size, head_dim)
            e_sym = (sym // 2) % (_ESCAPE + 1)
            esc = e_sym == _ESCAPE
            exp = ref[new] + e_sym + _LO
            k = int(esc.sum())
            if n_esc + k > escaped.size:
                raise CorruptStreamError("lossless stream ran out of escaped exponents")
            exp[esc] = escaped[n_esc : n_esc + k]
            n_esc += k
            rows.code(t, new, sym, exp, low[n_low : n_low + new.size])
            n_low += new.size
            rows.advance(t)
        if n_esc != escaped.size or (rows.exp < 0).any() or (rows.exp >= 1 << e_bits).any():
            raise CorruptStreamError("lossless stream exponents are inconsistent")
        sign = (rows.sym // _SIGNED) ^ majority.reshape(heads, head_dim)
        man = ((rows.sym & 1) << (m_bits - 1)) | rows.low
        bits = join(sign, rows.exp, man, head.dtype).transpose(1, 0, 2)
        storage = np.ascontiguousarray(bits).view(STORAGE_DTYPES[head.dtype])
        return KVBlock(storage, head.dtype, head.kind)


class _Rows:
    """The decoder's rebuilt fields (token-major) and what copies and contexts need."""

    def __init__(self, seq_len: int, heads: int, head_dim: int, ref: np.ndarray) -> None:
        self.sym = np.zeros((seq_len, heads, head_dim), dtype=np.int64)
        self.exp = np.zeros_like(self.sym)
        self.low = np.zeros_like(self.sym)
        self.context = np.full((heads, head_dim), _context(0, 0))
        self._ref = ref
        self._origin = np.zeros((heads, min(seq_len, MAX_ORDINAL)), dtype=np.int64)
        self._count = np.zeros(heads, dtype=np.int64)  # coded vectors so far, per head

    def copy(self, t: int, h: int, ordinal: int) -> None:
        """Token t of head h repeats the head's ``ordinal``-th coded vector."""
        if ordinal >= min(self._count[h], MAX_ORDINAL):
            raise CorruptStreamError("lossless stream copies a vector that was not coded yet")
        src = self._origin[h, ordinal]
        for field in (self.sym, self.exp, self.low):
            field[t, h] = field[src, h]

    def code(
        self, t: int, heads: np.ndarray, sym: np.ndarray, exp: np.ndarray, low: np.ndarray
    ) -> None:
        """Token t of ``heads`` was coded: store it and remember where ordinals point."""
        self.sym[t, heads], self.exp[t, heads], self.low[t, heads] = sym, exp, low
        room = heads[self._count[heads] < MAX_ORDINAL]
        self._origin[room, self._count[room]] = t
        self._count[heads] += 1

    def advance(self, t: int) -> None:
        """Token t is complete: it gives token t+1 its contexts."""
        self.context = _context(self.sym[t] // _SIGNED, self.exp[t] - self._ref)
