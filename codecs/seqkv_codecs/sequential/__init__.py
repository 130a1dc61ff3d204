"""Sequential token coding: model logits -> integer frequencies -> range coder."""

from seqkv_codecs.sequential.batch_decode import decode_tokens
from seqkv_codecs.sequential.logits_model import LogitsModel
from seqkv_codecs.sequential.probability import (
    MAX_PRECISION_BITS,
    code_length_bits,
    cumulative,
    find_symbol,
    frequencies_from_logits,
    frequencies_from_logits_torch,
    intervals_from_logits,
    reference_frequencies,
)
from seqkv_codecs.sequential.rangecoder import (
    RangeDecoder,
    RangeEncoder,
    decode_symbol,
    decode_with_tables,
    encode_symbol,
    encode_with_tables,
)
from seqkv_codecs.sequential.token_coder import (
    TokenStats,
    TokenStreamInfo,
    encode_tokens,
    encode_tokens_with_stats,
    read_token_stream_info,
)

__all__ = [
    "MAX_PRECISION_BITS",
    "LogitsModel",
    "RangeDecoder",
    "RangeEncoder",
    "TokenStats",
    "TokenStreamInfo",
    "code_length_bits",
    "cumulative",
    "decode_symbol",
    "decode_tokens",
    "decode_with_tables",
    "encode_symbol",
    "encode_tokens",
    "encode_tokens_with_stats",
    "encode_with_tables",
    "find_symbol",
    "frequencies_from_logits",
    "frequencies_from_logits_torch",
    "intervals_from_logits",
    "read_token_stream_info",
    "reference_frequencies",
]
