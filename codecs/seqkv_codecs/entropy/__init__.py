"""Static entropy coding of integer symbols: lane-interleaved rANS on the CPU or a GPU.

Every backend writes identical bytes (docs/format/ENTROPY_STREAM.md); ``backend`` only chooses where
the work runs: ``"numpy"`` (the CPU coder), ``"cuda"`` (numba CUDA kernels, `rans_cuda`),
``"torch"`` (the numpy coder as torch ops, any torch device) or ``"auto"`` (the CUDA kernels
for long streams when `placement` has a CUDA device selected, else numpy). Alphabets past
65,536 symbols (token ids of large vocabularies) are written as version 2 (`wide`): 16-bit
planes, each a version-1 stream coded on the chosen backend. Importing this package imports
neither torch nor numba.
"""

from __future__ import annotations

import numpy as np

from seqkv_codecs.entropy import placement, rans_numpy, stream, wide
from seqkv_codecs.entropy.rans_torch import decode_symbols_torch, encode_symbols_torch
from seqkv_codecs.errors import AlphabetTooLargeError, CodecError

__all__ = ["decode_symbols", "decode_symbols_torch", "encode_symbols", "encode_symbols_torch"]

_BACKENDS = ("numpy", "torch", "cuda", "auto")
_COUNT_CHUNK = 1 << 20  # bincount converts to intp; chunks keep that copy in cache


def encode_symbols(
    symbols: np.ndarray,
    alphabet_size: int,
    *,
    backend: str = "numpy",
    device: str | None = None,
    lanes: int | None = None,
) -> bytes:
    """Entropy-code a 1-D integer array whose values lie in ``[0, alphabet_size)``.

    ``lanes`` overrides the default lane count (more lanes suit a GPU); the decoder reads it
    from the stream. An alphabet past 65,536 symbols (up to 2**32 - 1) gives a version-2
    stream, whose planes choose their own lanes.
    """
    _check_backend(backend, device)
    if _is_wide(alphabet_size):
        symbols = _checked(symbols)
        if lanes is not None:
            raise ValueError("lanes cannot be chosen for alphabets past 65,536 symbols")
        if symbols.size:
            stream.check_range(int(symbols.min()), int(symbols.max()), alphabet_size)
        return wide.encode(
            symbols,
            int(alphabet_size),
            lambda plane, size: encode_symbols(plane, size, backend=backend, device=device),
        )
    if backend == "auto":
        backend = placement.backend_for(np.size(symbols))
        if backend == "cuda":
            try:
                return _encode_cuda(symbols, alphabet_size, placement.device(), lanes)
            except (CodecError, ValueError, TypeError):
                raise
            except Exception as exc:  # the kernels cannot run here; numpy gives the same bytes
                placement.gpu_failed(f"{type(exc).__name__}: {exc}")
                backend = "numpy"
    if backend == "cuda":
        return _encode_cuda(symbols, alphabet_size, device, lanes)
    alphabet_size = stream.check_alphabet(alphabet_size)
    symbols = _checked(symbols)
    if backend == "torch":
        import torch

        native = np.ascontiguousarray(symbols, dtype=symbols.dtype.newbyteorder("="))
        return encode_symbols_torch(
            torch.from_numpy(native).to(device or "cpu"),
            alphabet_size,
            lanes=lanes,
        )
    n = symbols.size
    if n:
        stream.check_range(int(symbols.min()), int(symbols.max()), alphabet_size)
    symbols = np.ascontiguousarray(symbols)
    counts = np.zeros(alphabet_size, dtype=np.int64)
    for start in range(0, n, _COUNT_CHUNK):
        chunk = symbols[start : start + _COUNT_CHUNK].astype(np.intp, copy=False)
        counts += np.bincount(chunk, minlength=alphabet_size)
    return stream.encode_stream(
        counts,
        n,
        alphabet_size,
        lanes,
        lambda freqs, precision, lanes: rans_numpy.encode(symbols, freqs, precision, lanes),
    )


def decode_symbols(
    data: bytes | memoryview,
    *,
    backend: str = "numpy",
    device: str | None = None,
    max_symbols: int | None = None,
) -> np.ndarray:
    """Decode a stream from :func:`encode_symbols`: uint8 if its alphabet has <= 256 symbols,
    uint16 up to 65,536, else uint32 (a version-2 stream).

    A stream of one repeated symbol is a few bytes whatever its length; pass ``max_symbols``
    when the data is untrusted and the expected length is known.
    """
    _check_backend(backend, device)
    if len(data) and data[0] == wide.VERSION:
        return wide.decode(
            data,
            max_symbols,
            lambda plane, count: decode_symbols(
                plane, backend=backend, device=device, max_symbols=count
            ),
        )
    if backend == "auto":
        backend = placement.backend_for(stream.symbol_count(data))
        if backend == "cuda":
            try:
                return _decode_cuda(data, placement.device(), max_symbols)
            except CodecError:
                raise
            except Exception as exc:  # the kernels cannot run here; numpy gives the same symbols
                placement.gpu_failed(f"{type(exc).__name__}: {exc}")
                backend = "numpy"
    if backend == "cuda":
        return _decode_cuda(data, device, max_symbols)
    if backend == "torch":
        return decode_symbols_torch(data, device or "cpu", max_symbols=max_symbols).cpu().numpy()
    parsed = stream.unpack(data, max_symbols)
    out = np.empty(parsed.n_symbols, dtype=stream.symbol_dtype(parsed.alphabet_size))
    if parsed.states.size == 0:  # zero or one distinct symbol
        out.fill(int(np.argmax(parsed.freqs)))
        return out
    return rans_numpy.decode(
        parsed.states, parsed.words, parsed.freqs, parsed.precision, parsed.n_symbols, out
    )


def _encode_cuda(
    symbols: np.ndarray, alphabet_size: int, device: str | None, lanes: int | None
) -> bytes:
    from seqkv_codecs.entropy.rans_cuda import encode_symbols_cuda

    return encode_symbols_cuda(symbols, alphabet_size, lanes=lanes, device=device)


def _decode_cuda(
    data: bytes | memoryview, device: str | None, max_symbols: int | None
) -> np.ndarray:
    from seqkv_codecs.entropy.rans_cuda import decode_symbols_cuda

    return decode_symbols_cuda(data, max_symbols=max_symbols, device=device).copy_to_host()


def _is_wide(alphabet_size) -> bool:
    """Whether ``alphabet_size`` needs version 2 (past 65,536 and within its u32 field)."""
    if isinstance(alphabet_size, bool) or not isinstance(alphabet_size, int | np.integer):
        return False  # check_alphabet refuses it
    if alphabet_size > wide.MAX_ALPHABET:
        raise AlphabetTooLargeError(
            f"alphabet_size must be an integer in 1..{wide.MAX_ALPHABET}, got {alphabet_size}: "
            "an entropy stream holds at most 2**32 - 1 symbols"
        )
    return alphabet_size > stream.MAX_ALPHABET


def _checked(symbols) -> np.ndarray:
    symbols = np.asarray(symbols)
    if symbols.ndim != 1 or not np.issubdtype(symbols.dtype, np.integer):
        raise ValueError(
            f"symbols must be a 1-D integer array, got {symbols.ndim}-D {symbols.dtype}"
        )
    return symbols


def _check_backend(backend: str, device: str | None) -> None:
    if backend not in _BACKENDS:
        raise ValueError(f"unknown entropy backend {backend!r}; choose one of {_BACKENDS}")
    if backend in ("numpy", "auto") and device not in (None, "cpu"):
        raise ValueError(
            f"device={device!r} needs backend='torch' or 'cuda'; the numpy backend runs on CPU"
            " (and 'auto' follows entropy.placement)"
        )
