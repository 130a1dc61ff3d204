"""The GPU entropy coder: numba CUDA kernels around `lanes`, writing and reading stream version 1.

The stream format is the CPU's (docs/format/ENTROPY_STREAM.md); only the schedule differs.

**Encode** never makes one lane wait for another:

1. ``histogram``: symbol counts (shared-memory counters per block for alphabets up to
   `HIST_SHARED`, global atomics above); the host turns them into the table with the CPU's own
   integer code (`freq.table_from_counts`), so both build the same table;
2. ``encode_kernel``: one thread per lane runs `lanes.encode_lane`, last step first, and marks
   each symbol that emitted a word (``flags``) next to the word (``low``). Symbol ``i``'s
   word, if any, sits at index ``i``, and the format stores words in increasing ``i`` (step by
   step, lane by lane), so
3. ``count_kernel`` / ``scan_kernel`` / ``scatter_kernel``: a prefix sum over ``flags``
   (per chunk, then over chunks, then within each chunk) gives every word its place.

**Decode** is the part the format couples: the words a step's lanes read follow all words of
the earlier steps, in lane order, so each step needs the count of every lane's words before
it. One cooperative kernel keeps all lanes resident (a thread owns up to `MAX_PER_THREAD`
consecutive lanes, in registers) and per step: decodes (`lanes.decode_lanes`), scans the
block's counts in shared memory, publishes the block's total, waits at a grid barrier, sums
the totals of the blocks before it, and refills (`lanes.refill_lanes`). A decode therefore
costs about one grid barrier per step (``ceil(n / lanes)`` steps), which is what bounds it on
a GPU; bench/gpu/check.py reports the time per step.

`rans_lanes_cpu` runs the same `lanes` functions on the CPU with the same `geometry`; CI
checks both against the numpy coder (tests/codecs/test_entropy_kernel.py), the kernels here
under numba's CUDA simulator. numba is imported on first use only.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np

from seqkv_codecs.entropy import stream
from seqkv_codecs.entropy.freq import decoder_tables, encoder_table
from seqkv_codecs.entropy.geometry import (
    CHUNK_TILES,
    MAX_THREADS,
    TILE_ITEMS,
    decode_geometry,
)
from seqkv_codecs.errors import CorruptStreamError


def available() -> bool:
    """Whether numba sees a CUDA GPU (or runs its simulator, NUMBA_ENABLE_CUDASIM=1)."""
    try:
        from numba import cuda
    except ImportError:
        return False
    try:
        return bool(cuda.is_available())
    except Exception:  # a broken driver or toolkit: the CPU coder gives the same bytes
        return False


def encode_symbols_cuda(
    symbols: Any,
    alphabet_size: int,
    *,
    lanes: int | None = None,
    device: str | None = None,
    threads: int = MAX_THREADS,
) -> bytes:
    """Entropy-code a 1-D integer array on the GPU: a numpy array (copied over), or a device
    array (numba, or a torch CUDA tensor: anything with ``__cuda_array_interface__``).
    ``threads`` per block of the encode kernels (tests use fewer)."""
    alphabet_size = stream.check_alphabet(alphabet_size)
    with _on(device):
        d_sym = _device_symbols(symbols)
        counts = histogram(d_sym, alphabet_size, threads)
        return stream.encode_stream(
            counts,
            d_sym.size,
            alphabet_size,
            lanes,
            lambda freqs, precision, lanes: _host_parts(
                encode_device(d_sym, freqs, precision, lanes, threads)
            ),
        )


def decode_symbols_cuda(
    data: bytes | memoryview,
    *,
    max_symbols: int | None = None,
    device: str | None = None,
    per_thread: int | None = None,
) -> Any:
    """Decode a stream on the GPU into a numba device array (uint8, or uint16 for alphabets
    above 256 symbols); ``torch.as_tensor(result, device="cuda")`` shares it without a copy."""
    parsed = stream.unpack(data, max_symbols)
    with _on(device):
        return decode_device(upload(parsed), per_thread=per_thread)


@dataclass
class DeviceStream:
    """A parsed stream's arrays on the GPU: what a decode launch reads."""

    n_symbols: int
    precision: int
    dtype: np.dtype
    fill: int  # the one symbol of a stream without lanes
    states: Any
    words: Any  # padded by one word, so an empty stream still has an array
    n_words: int
    slot_sym: Any
    slot_packed: Any
    host: stream.Stream  # kept for a stream with more lanes than the GPU holds at once


def upload(parsed: stream.Stream) -> DeviceStream:
    """Copy a parsed stream and its decoder tables to the GPU."""
    from numba import cuda

    dtype = stream.symbol_dtype(parsed.alphabet_size)
    if parsed.states.size == 0:
        empty = cuda.to_device(np.zeros(1, np.int64))
        fill = int(np.argmax(parsed.freqs))
        return DeviceStream(parsed.n_symbols, 0, dtype, fill, empty, empty, 0, empty, empty, parsed)
    slot_sym, slot_packed = decoder_tables(parsed.freqs, parsed.precision)
    return DeviceStream(
        parsed.n_symbols,
        parsed.precision,
        dtype,
        0,
        cuda.to_device(parsed.states.astype(np.int64)),
        cuda.to_device(np.concatenate((parsed.words, np.zeros(1, np.uint16)))),
        parsed.words.size,
        cuda.to_device(slot_sym.astype(dtype)),
        cuda.to_device(slot_packed.astype(np.int64)),
        parsed,
    )


def encode_device(
    d_sym: Any, freqs: np.ndarray, precision: int, lanes: int, threads: int = MAX_THREADS
) -> tuple[Any, Any]:
    """(lane states, words) of ``d_sym`` as device arrays: the kernels of steps 2 and 3.
    ``threads`` per block (fewer in tests: they also make compaction chunks smaller)."""
    from numba import cuda

    k = _kernels()
    n = d_sym.size
    table = cuda.to_device(encoder_table(freqs).astype(np.int64))
    flags = _scratch("flags", n, np.uint8)
    low = _scratch("low", n, np.uint16)
    states = cuda.device_array(lanes, np.int64)
    k.encode[-(-lanes // threads), threads](
        d_sym, n, lanes, table, 32 - precision, 1 << precision, flags, low, states
    )
    chunk = threads * TILE_ITEMS * CHUNK_TILES
    chunks = -(-n // chunk)
    offsets = cuda.device_array(chunks, np.int64)
    k.count[chunks, threads](flags, n, chunk, offsets)
    total = cuda.device_array(1, np.int64)
    k.scan[1, threads](offsets, chunks, total)
    n_words = int(total.copy_to_host()[0])
    words = cuda.device_array(max(n_words, 1), np.uint16)
    k.scatter[chunks, threads](flags, low, n, chunk, offsets, words)
    return states, words[:n_words]


def decode_device(ds: DeviceStream, *, per_thread: int | None = None) -> Any:
    """Decode an uploaded stream into a new device array; raise CorruptStreamError where the
    numpy decoder would (the same end checks: exactly W words read, every lane back at 2**16)."""
    from numba import cuda

    k = _kernels()
    out = cuda.device_array(ds.n_symbols, ds.dtype)
    if ds.n_symbols == 0:
        return out
    if ds.precision == 0:
        k.fill[-(-ds.n_symbols // MAX_THREADS), MAX_THREADS](out, ds.n_symbols, ds.fill)
        return out
    lanes = ds.states.size
    kernel, sig = k.decode[ds.dtype.itemsize]
    geometry = decode_geometry(lanes, kernel.overloads[sig].max_cooperative_grid_blocks, per_thread)
    if geometry is None:  # more lanes than the GPU holds at once: the CPU decodes them
        global host_decodes
        host_decodes += 1
        return cuda.to_device(_decode_on_host(ds.host))
    steps, last = stream.step_shape(ds.n_symbols, lanes)
    status = cuda.to_device(np.zeros(4, np.int64))
    block_counts = cuda.device_array((2, geometry.blocks), np.int64)
    kernel[geometry.blocks, geometry.threads](
        ds.states, ds.words, ds.n_words, ds.slot_sym, ds.slot_packed, ds.precision,
        lanes, steps, last, geometry.per_thread, out, block_counts, status,
    )  # fmt: skip
    overrun, unfinished, read = (int(v) for v in status.copy_to_host()[:3])
    if overrun or read > ds.n_words:
        raise CorruptStreamError("rANS stream ran out of words")
    if read != ds.n_words:
        raise CorruptStreamError(f"rANS stream has {ds.n_words - read} unread words")
    if unfinished:
        raise CorruptStreamError("rANS lanes did not end in their initial state")
    return out


def release_workspace() -> None:
    """Free the encoder's scratch buffers (kept between calls: allocating ~3 bytes per symbol
    on every call would cost more than the kernels on large streams)."""
    _workspace.clear()


_workspace: dict[str, Any] = {}
host_decodes = 0  # streams with more lanes than fit on the GPU at once, decoded by numpy


def _scratch(name: str, size: int, dtype: type) -> Any:
    from numba import cuda

    held = _workspace.get(name)
    if held is None or held.size < size:
        held = _workspace[name] = cuda.device_array(max(size, 1), dtype)
    return held[:size]


def _host_parts(parts: tuple[Any, Any]) -> tuple[np.ndarray, np.ndarray]:
    states, words = parts
    host_words = words.copy_to_host() if words.size else np.zeros(0, np.uint16)
    return states.copy_to_host().astype(np.uint32), host_words


def _decode_on_host(parsed: stream.Stream) -> np.ndarray:
    from seqkv_codecs.entropy import rans_numpy

    out = np.empty(parsed.n_symbols, stream.symbol_dtype(parsed.alphabet_size))
    return rans_numpy.decode(
        parsed.states, parsed.words, parsed.freqs, parsed.precision, parsed.n_symbols, out
    )


def _device_symbols(symbols: Any) -> Any:
    from numba import cuda

    if getattr(cuda, "is_cuda_ndarray", lambda _: False)(symbols):  # numba's own (simulated)
        d_sym = symbols
    elif hasattr(symbols, "__cuda_array_interface__"):  # a torch CUDA tensor, a cupy array
        d_sym = cuda.as_cuda_array(symbols)
    else:
        host = np.asarray(symbols)
        if not np.issubdtype(host.dtype, np.integer):
            raise ValueError(f"symbols must be a 1-D integer array, got {host.dtype}")
        d_sym = cuda.to_device(np.ascontiguousarray(host, host.dtype.newbyteorder("=")))
    if d_sym.ndim != 1 or not np.issubdtype(d_sym.dtype, np.integer):
        raise ValueError(f"symbols must be a 1-D integer array, got {d_sym.ndim}-D {d_sym.dtype}")
    if d_sym.size and d_sym.strides[0] != d_sym.dtype.itemsize:
        raise ValueError("symbols on the GPU must be contiguous")
    return d_sym


def histogram(d_sym: Any, alphabet_size: int, threads: int = MAX_THREADS) -> np.ndarray:
    """Symbol counts (int64, host); ValueError naming the range when a symbol is outside the
    alphabet, as the CPU coder does."""
    from numba import cuda

    k = _kernels()
    n = d_sym.size
    counts = cuda.to_device(np.zeros(alphabet_size, np.int64))
    status = cuda.to_device(np.zeros(1, np.int64))
    if n:
        # ~64 symbols a thread, at most 1024 blocks: per-block counts stay far below 2**31
        blocks = max(1, min(-(-n // (threads * 64)), 1024))
        k.histogram[blocks, threads](d_sym, n, alphabet_size, counts, status)
        if status.copy_to_host()[0]:
            host = d_sym.copy_to_host()
            stream.check_range(int(host.min()), int(host.max()), alphabet_size)
    return counts.copy_to_host()


@contextlib.contextmanager
def _on(device: str | None):
    """Run on GPU ``N`` of ``cuda:N`` (numba's numbering, which is CUDA's); ``cuda`` alone is
    the current one."""
    name = (device or "cuda").strip().lower()
    if name.startswith("cuda:"):
        from numba import cuda

        with cuda.gpus[int(name.partition(":")[2])]:
            yield
    elif name == "cuda":
        yield
    else:
        raise ValueError(f"the CUDA entropy coder runs on cuda or cuda:N, not {device!r}")


@functools.cache
def _kernels() -> SimpleNamespace:
    """Compile the kernels (once per process: seconds of NVVM). The cooperative decode is
    compiled for its two symbol types up front, since its grid size needs the compiled kernel;
    the others when first launched."""
    from numba import cuda

    from seqkv_codecs.entropy import cuda_kernels as source

    decoders = {}
    for symbol in ("uint8", "uint16"):
        compiled = cuda.jit(source.DECODE_SIGNATURE.replace("S", symbol))(source.decode)
        # its one overload (the simulator keeps none, and answers for any key)
        decoders[np.dtype(symbol).itemsize] = (compiled, next(iter(compiled.overloads), None))
    names = ("histogram", "encode", "count", "scan", "scatter", "fill")
    return SimpleNamespace(decode=decoders, **{k: cuda.jit(getattr(source, k)) for k in names})
