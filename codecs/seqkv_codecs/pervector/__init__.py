"""Per-vector KV codecs: each treats every cached key/value vector on its own.

They are the baselines that sequential compression is measured against (bits per component),
and the building blocks a pipeline can put after a sequential stage. Importing this package
registers all of them.
"""

from seqkv_codecs.pervector.int8 import Int8Codec
from seqkv_codecs.pervector.kivi import Kivi2Codec, Kivi4Codec
from seqkv_codecs.pervector.lossless import LosslessCodec
from seqkv_codecs.pervector.raw import RawCodec
from seqkv_codecs.pervector.turbo import Turbo3Codec, Turbo4Codec
from seqkv_codecs.registry import register_codec

PERVECTOR_CODECS = (
    RawCodec,
    LosslessCodec,
    Int8Codec,
    Kivi2Codec,
    Kivi4Codec,
    Turbo3Codec,
    Turbo4Codec,
)
for _cls in PERVECTOR_CODECS:
    register_codec(_cls)

__all__ = [
    "PERVECTOR_CODECS",
    "Int8Codec",
    "Kivi2Codec",
    "Kivi4Codec",
    "LosslessCodec",
    "RawCodec",
    "Turbo3Codec",
    "Turbo4Codec",
]
