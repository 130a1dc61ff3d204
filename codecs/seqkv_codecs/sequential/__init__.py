"""Sequential token coding: model logits -> integer frequencies -> range coder."""

from seqkv_codecs.sequential.probability import (
    MAX_PRECISION_BITS,
    code_length_bits,
    cumulative,
    frequencies_from_logits,
    frequencies_from_logits_torch,
)
from seqkv_codecs.sequential.rangecoder import (
    RangeDecoder,
    RangeEncoder,
    decode_symbol,
    decode_with_tables,
    encode_symbol,
    encode_with_tables,
)

__all__ = [
    "MAX_PRECISION_BITS",
    "RangeDecoder",
    "RangeEncoder",
    "code_length_bits",
    "cumulative",
    "decode_symbol",
    "decode_with_tables",
    "encode_symbol",
    "encode_with_tables",
    "frequencies_from_logits",
    "frequencies_from_logits_torch",
]
