"""seqkv_codecs: entropy coders, per-vector KV codecs and sequential coding primitives.

The library knows nothing about the CLI or about loading models; it works on numpy arrays
(and torch tensors where a GPU path exists). Codecs follow numcodecs: `get_codec(config)`,
`codec.encode(block)`, `codec.decode(data)`, JSON-safe `get_config()`.
"""

from seqkv_codecs.base import Codec
from seqkv_codecs.errors import CodecError, CorruptStreamError, UnknownCodecError
from seqkv_codecs.kvblock import KVBlock
from seqkv_codecs.registry import available_codecs, get_codec, register_codec

__all__ = [
    "Codec",
    "CodecError",
    "CorruptStreamError",
    "KVBlock",
    "UnknownCodecError",
    "available_codecs",
    "get_codec",
    "register_codec",
]
