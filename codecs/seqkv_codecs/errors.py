"""Exception types of the codec library; the CLI turns each into one line on stderr."""


class CodecError(Exception):
    """Base class of every error the codec library raises on purpose."""


class UnknownCodecError(CodecError, ValueError):
    """A codec id that no registered codec answers to."""


class CorruptStreamError(CodecError):
    """An encoded stream that cannot be decoded: truncated, inconsistent or tampered with."""


class AlphabetTooLargeError(CodecError, ValueError):
    """More symbols than a stream can hold (an entropy stream: 2**32 - 1): a hard limit a
    model's vocabulary can reach, so the CLI says it in one line (a ValueError for the API)."""
