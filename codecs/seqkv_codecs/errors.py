"""Exception types of the codec library; the CLI turns each into one line on stderr."""


class CodecError(Exception):
    """Base class of every error the codec library raises on purpose."""


class UnknownCodecError(CodecError, ValueError):
    """A codec id that no registered codec answers to."""


class CorruptStreamError(CodecError):
    """An encoded stream that cannot be decoded: truncated, inconsistent or tampered with."""
