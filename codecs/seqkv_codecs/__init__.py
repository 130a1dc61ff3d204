"""seqkv_codecs: entropy coders, per-vector KV codecs and sequential codecs.

The library knows nothing about the CLI or about loading models; it works on numpy arrays
(and torch tensors where a GPU path exists).
"""

from seqkv_codecs.errors import CodecError, CorruptStreamError, UnknownCodecError

__all__ = ["CodecError", "CorruptStreamError", "UnknownCodecError"]
