"""The `Codec` base class (numcodecs-style) and the 13-byte header every KV codec stream opens with;
`Configurable`, the config round trip it shares with seqkv's session codecs.

A codec turns one `KVBlock` into bytes and back. Its configuration is a JSON-safe dict with an
``"id"``; a pipeline is a list of such dicts, stored in the container so that every file says
how to decode itself. The stream is self-contained as well: shape, dtype and kind live in a
small header, so a stream decodes without its container.

Header layout, little-endian, 13 bytes::

    0   2  magic: two ASCII bytes naming the codec family (catches a stream fed to the wrong codec)
    2   1  stream version (uint8) of that codec's layout
    3   1  dtype: 0 bf16, 1 fp16, 2 fp32
    4   1  kind: 0 key, 1 value
    5   2  num_kv_heads (uint16)
    7   4  seq_len (uint32)
    11  2  head_dim (uint16)
"""

from __future__ import annotations

import struct
from abc import ABC, abstractmethod
from typing import Any, ClassVar, NamedTuple

from seqkv_codecs.errors import CodecError, CorruptStreamError
from seqkv_codecs.framing import StreamReader
from seqkv_codecs.kvblock import KINDS, STORAGE_DTYPES, KVBlock

_HEADER = struct.Struct("<2sBBBHIH")
_FIELDS = "<BBHIH"  # _HEADER after its magic and version
_DTYPES = tuple(STORAGE_DTYPES)


class StreamHeader(NamedTuple):
    """What a stream says about the block it holds."""

    version: int
    dtype: str
    kind: str
    shape: tuple[int, int, int]


class Configurable(ABC):
    """A coder whose parameters form a JSON-safe config dict with an ``"id"`` (numcodecs-style):
    `get_config` writes it, `from_config` makes the coder again. Shared by the codec library's
    codecs and seqkv's session codecs, which differ only in the error a bad config raises."""

    codec_id: ClassVar[str]
    #: what `from_config` raises for a config this class cannot take
    config_error: ClassVar[type[Exception]] = CodecError

    @abstractmethod
    def get_config(self) -> dict[str, Any]:
        """JSON-safe parameters, ``"id"`` first."""

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Configurable:
        """Instantiate from `get_config` output."""
        params = dict(config)
        codec_id = params.pop("id", cls.codec_id)
        if codec_id != cls.codec_id:
            raise cls.config_error(f"config for codec {codec_id!r} given to codec {cls.codec_id!r}")
        try:
            return cls(**params)
        except TypeError as exc:
            raise cls.config_error(f"bad config for codec {cls.codec_id!r}: {exc}") from None


class Codec(Configurable):
    """Encodes one `KVBlock` to bytes and back.

    Subclasses set the class attributes, keep their parameters as public instance attributes
    (they form the config) and implement `encode` and `decode`.
    """

    codec_id: ClassVar[str]
    description: ClassVar[str]
    lossless: ClassVar[bool]
    typical_bits_per_component: ClassVar[float | None] = None
    #: two ASCII bytes opening every stream of this codec
    stream_magic: ClassVar[bytes]
    #: layout version written into the header; bump it whenever the bytes change
    stream_version: ClassVar[int] = 1

    @abstractmethod
    def encode(self, block: KVBlock) -> bytes:
        """Compress ``block`` into a self-contained stream."""

    @abstractmethod
    def decode(self, data: bytes | memoryview) -> KVBlock:
        """Restore the block; raises `CorruptStreamError` on anything malformed."""

    def decode_checked(
        self,
        data: bytes | memoryview,
        shape: tuple[int, int, int],
        dtype: str | None = None,
        kind: str | None = None,
    ) -> KVBlock:
        """`decode`, but a stream whose header is not the expected block is refused first.

        The header sizes every allocation of a decode; a caller that knows the shape (from
        its container entry) checks it here, before the work, not after.
        """
        _, head = self._open(data)
        want = tuple(int(n) for n in shape)
        if head.shape != want or (dtype is not None and head.dtype != dtype):
            raise CorruptStreamError(
                f"{self.codec_id!r} stream holds a {head.dtype} block of shape {head.shape}, "
                f"expected {dtype or head.dtype} {want}"
            )
        if kind is not None and head.kind != kind:
            raise CorruptStreamError(f"{self.codec_id!r} stream holds {head.kind}s, not {kind}s")
        block = self.decode(data)
        if block.shape != want or block.dtype != head.dtype:
            raise CorruptStreamError(f"{self.codec_id!r} stream decodes to a different block")
        return block

    def get_config(self) -> dict[str, Any]:
        """JSON-safe parameters, ``"id"`` first."""
        params = {k: v for k, v in vars(self).items() if not k.startswith("_")}
        return {"id": self.codec_id, **params}

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Codec):
            return NotImplemented
        return self.get_config() == other.get_config()

    def __hash__(self) -> int:
        return hash(repr(self))

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items() if k != "id")
        return f"{type(self).__name__}({params})"

    def _header(self, block: KVBlock) -> bytes:
        """The stream header for ``block``; refuses shapes the header cannot hold."""
        heads, seq_len, head_dim = block.shape
        if heads > 0xFFFF or head_dim > 0xFFFF or seq_len > 0xFFFFFFFF:
            raise CodecError(f"block shape {block.shape} is too large for a codec stream")
        return _HEADER.pack(
            self.stream_magic,
            self.stream_version,
            _DTYPES.index(block.dtype),
            KINDS.index(block.kind),
            heads,
            seq_len,
            head_dim,
        )

    def _open(self, data: bytes | memoryview) -> tuple[StreamReader, StreamHeader]:
        """Check the header of ``data``; returns a reader positioned after it."""
        reader = StreamReader(data, repr(self.codec_id))
        version = reader.opening(self.stream_magic, (self.stream_version,))
        dtype, kind, heads, seq_len, head_dim = reader.unpack(_FIELDS)
        if dtype >= len(_DTYPES) or kind >= len(KINDS) or heads == 0 or head_dim == 0:
            raise CorruptStreamError(f"{self.codec_id!r} stream header is malformed")
        return reader, StreamHeader(
            version, _DTYPES[dtype], KINDS[kind], (heads, seq_len, head_dim)
        )
