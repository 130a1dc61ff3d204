"""The GPU entropy coder against the CPU coder: the streams, the identity check, the speed.

One set of streams and one check, run in three places: CI runs `check` on `random_cases` and
real K/V byte planes through the kernel source compiled for the CPU (`rans_lanes_cpu`) and,
on a few small streams, through the CUDA kernels under numba's simulator
(tests/codecs/test_entropy_kernel.py); bench/gpu/check.py runs it on a GPU at scale, then
measures GB/s on 256 MB of bf16 K/V byte planes (`speed`) and where the GPU starts to pay
(`crossover`). Importing this module imports numpy only.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from seqkv_codecs.entropy import decode_symbols, encode_symbols, stream
from seqkv_codecs.pervector._symbols import lanes_for

Encoder = Callable[[np.ndarray, int, int | None], bytes]  # (symbols, alphabet, lanes)
Decoder = Callable[[bytes], np.ndarray]


@dataclass(frozen=True)
class Case:
    """One stream to code both ways: symbols, alphabet, lanes (None: the default)."""

    name: str
    symbols: np.ndarray
    alphabet: int
    lanes: int | None = None


def kv_planes(mb: float, seed: int = 0) -> dict[str, np.ndarray]:
    """High and low byte planes of ``mb`` MB of bf16 values shaped like K/V (per-channel
    scale; Gaussian values, log-normal channel scales)."""
    n = int(mb * 1e6) // 2
    rng = np.random.default_rng(seed)
    scale = np.exp(rng.normal(0.0, 1.5, 64)).astype(np.float32)
    values = rng.standard_normal((n // 64 + 1, 64), dtype=np.float32) * scale
    codes = (values.reshape(-1)[:n].view(np.uint32) >> 16).astype(np.uint16)
    return {"kv-high-byte": (codes >> 8).astype(np.uint8), "kv-low-byte": codes.astype(np.uint8)}


def bf16_planes(name: str, bits: np.ndarray) -> list[Case]:
    """The two byte planes of bf16 bit patterns (uint16), as per-vector codecs would code
    them (their lane count)."""
    bits = np.ascontiguousarray(bits, dtype=np.uint16).reshape(-1)
    planes = {"high": (bits >> 8).astype(np.uint8), "low": (bits & 0xFF).astype(np.uint8)}
    return [Case(f"{name}-{k}", v, 256, lanes_for(v.size)) for k, v in planes.items()]


def random_cases(count: int, seed: int, max_symbols: int = 4 << 20) -> list[Case]:
    """``count`` streams: sizes from 0 to ``max_symbols`` (most small, a few MB-sized), flat and
    skewed histograms, alphabets from 1 to 65,536, the default, the per-vector and random lane
    counts (those random ones bounded to ~2,048 steps: the numpy coder pays ~12 us a step)."""
    rng = np.random.default_rng(seed)
    return [_case(rng, i, max_symbols) for i in range(count)]


def _case(rng: np.random.Generator, i: int, max_symbols: int) -> Case:
    size_class = rng.random()
    if i < 4:  # the edges: empty, one symbol, two symbols, a ragged last step
        n = (0, 1, 2, 1025)[i]
    elif size_class < 0.6:
        n = int(rng.integers(3, 4096))
    elif size_class < 0.95:
        n = int(rng.integers(4096, max(4097, max_symbols // 16)))
    else:
        n = int(rng.integers(max(1, max_symbols // 4), max_symbols + 1))
    kind = str(rng.choice(["flat", "geometric", "zipf", "sparse", "few", "bf16"]))
    alphabet = int(rng.choice([2, 3, 17, 256, 4096, 4097, 40_000, 65_536]))
    if kind == "flat":
        symbols = rng.integers(0, alphabet, n)
    elif kind == "geometric":
        symbols = np.minimum(rng.geometric(rng.uniform(0.02, 0.95), n) - 1, alphabet - 1)
    elif kind == "zipf":
        symbols = np.minimum(rng.zipf(rng.uniform(1.1, 2.5), n) - 1, alphabet - 1)
    elif kind == "sparse":  # one symbol almost everywhere: the longest runs without words
        symbols = np.where(rng.random(n) < rng.uniform(0.0005, 0.01), 1, 0) % alphabet
    elif kind == "few":  # K = 1..3 distinct symbols (K = 1: no lanes at all)
        picks = rng.choice(alphabet, size=min(alphabet, int(rng.integers(1, 4))), replace=False)
        symbols = picks[rng.integers(0, picks.size, n)]
    else:
        alphabet = 256
        plane = str(rng.choice(["kv-high-byte", "kv-low-byte"]))
        symbols = kv_planes(max(n, 64) * 2 / 1e6, seed=i)[plane][:n]
    symbols = symbols.astype(stream.symbol_dtype(alphabet))
    low_lanes = max(1, -(-n // stream.MAX_STEPS))
    lane_kind = rng.random()
    if lane_kind < 0.3 or n == 0:
        lanes = None
    elif lane_kind < 0.6:
        lanes = lanes_for(n)
    else:  # any valid count, at most ~2048 steps
        lanes = int(rng.integers(max(low_lanes, -(-n // 2048)), max(n, 1) + 1))
    return Case(f"random-{i}-{kind}-A{alphabet}", symbols, alphabet, lanes)


def check(cases: list[Case], encode: Encoder, decode: Decoder) -> Iterator[dict]:
    """Each case both ways: the kernel's bytes equal numpy's, numpy decodes the kernel's
    stream, the kernel decodes numpy's. Yields one row per case (failures name what failed)."""
    for case in cases:
        cpu = encode_symbols(case.symbols, case.alphabet, lanes=case.lanes)
        kernel = encode(case.symbols, case.alphabet, case.lanes)
        failed = []
        if kernel != cpu:
            failed.append("bytes differ")
        if not np.array_equal(decode_symbols(kernel), case.symbols):
            failed.append("numpy does not decode the kernel's stream")
        if not np.array_equal(decode(cpu), case.symbols):
            failed.append("the kernel does not decode numpy's stream")
        yield {
            "case": case.name,
            "symbols": int(case.symbols.size),
            "alphabet": case.alphabet,
            "lanes": stream.unpack(cpu).states.size,
            "bytes": len(cpu),
            "failed": failed,
        }


def summary(rows: list[dict]) -> dict:
    bad = [r for r in rows if r["failed"]]
    return {
        "streams": len(rows),
        "symbols": int(sum(r["symbols"] for r in rows)),
        "largest": max((r["symbols"] for r in rows), default=0),
        "identical": len(rows) - len(bad),
        "failures": bad[:20],
    }


# --- on a GPU -------------------------------------------------------------------------------


def _sync() -> None:
    from numba import cuda

    cuda.synchronize()


def _best(fn: Callable[[], object], repeat: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeat):
        _sync()
        start = time.perf_counter()
        out = fn()
        _sync()
        best = min(best, time.perf_counter() - start)
    return best, out


def speed(plane: np.ndarray, lanes: int, repeat: int = 3) -> dict:
    """One byte plane on the GPU: device-resident encode (histogram, table, kernels) and
    decode (the cooperative kernel) in GB/s of symbols, end-to-end rates from and to host
    memory, the numpy coder's for comparison, and byte identity of it all."""
    from numba import cuda

    from seqkv_codecs.entropy import rans_cuda
    from seqkv_codecs.entropy.freq import table_from_counts

    d_sym = cuda.to_device(plane)
    counts = rans_cuda.histogram(d_sym, 256)
    precision, freqs = table_from_counts(counts)

    def device_encode():
        rans_cuda.histogram(d_sym, 256)
        return rans_cuda.encode_device(d_sym, freqs, precision, lanes)

    start = time.perf_counter()
    device_encode()  # compiles the kernels (the first call in a process)
    _sync()
    first_s = time.perf_counter() - start
    enc_s, _ = _best(device_encode, repeat)
    e2e_enc_s, blob = _best(lambda: rans_cuda.encode_symbols_cuda(plane, 256, lanes=lanes), 1)
    on_device = rans_cuda.upload(stream.unpack(blob))
    before = rans_cuda.host_decodes
    dec_s, out = _best(lambda: rans_cuda.decode_device(on_device), repeat)
    fell_back = rans_cuda.host_decodes != before
    e2e_dec_s, back = _best(lambda: rans_cuda.decode_symbols_cuda(blob).copy_to_host(), 1)
    cpu_enc_s, cpu_blob = _best(lambda: encode_symbols(plane, 256, lanes=lanes), 1)
    cpu_dec_s, cpu_back = _best(lambda: decode_symbols(cpu_blob), 1)
    steps = -(-plane.size // lanes)
    return {
        "symbols": int(plane.size),
        "lanes": lanes,
        "steps": steps,
        "bits_per_symbol": len(blob) * 8 / plane.size,
        "bytes_identical": blob == cpu_blob,
        "gpu_decodes_exactly": bool(np.array_equal(out.copy_to_host(), plane))
        and bool(np.array_equal(back, plane)),
        "cpu_decodes_gpu_stream": bool(np.array_equal(cpu_back, plane)),
        "decode_fell_back_to_cpu": fell_back,  # too many lanes to hold: numpy's speed
        "first_call_s": first_s,
        "gpu_encode_GBps": plane.size / enc_s / 1e9,
        "gpu_decode_GBps": plane.size / dec_s / 1e9,
        "gpu_decode_us_per_step": dec_s / steps * 1e6,
        "gpu_end_to_end_encode_GBps": plane.size / e2e_enc_s / 1e9,
        "gpu_end_to_end_decode_GBps": plane.size / e2e_dec_s / 1e9,
        "cpu_numpy_encode_GBps": plane.size / cpu_enc_s / 1e9,
        "cpu_numpy_decode_GBps": plane.size / cpu_dec_s / 1e9,
    }


def crossover(
    sizes: list[int], repeat: int = 3, lanes_of: Callable[[int], int] = lanes_for
) -> dict:
    """Host bytes in, host bytes out (what `backend="auto"` does for a per-vector stream):
    numpy against the GPU at each size (``lanes_of(n)`` lanes: the per-vector codecs' count),
    and the smallest size from which the GPU is faster both ways, at every larger size too:
    the value for `entropy.placement.GPU_MIN_SYMBOLS`."""
    from seqkv_codecs.entropy import rans_cuda

    rows = []
    for n in sizes:
        plane = kv_planes(n * 2 / 1e6, seed=n)["kv-high-byte"][:n]
        lanes = lanes_of(n)
        cpu_enc, blob = _best(lambda p=plane, k=lanes: encode_symbols(p, 256, lanes=k), repeat)
        cpu_dec, _ = _best(lambda b=blob: decode_symbols(b), repeat)
        gpu_enc, _ = _best(
            lambda p=plane, k=lanes: rans_cuda.encode_symbols_cuda(p, 256, lanes=k), repeat
        )
        gpu_dec, _ = _best(lambda b=blob: rans_cuda.decode_symbols_cuda(b).copy_to_host(), repeat)
        rows.append(
            {
                "symbols": n,
                "lanes": lanes,
                "cpu_encode_ms": cpu_enc * 1e3,
                "cpu_decode_ms": cpu_dec * 1e3,
                "gpu_encode_ms": gpu_enc * 1e3,
                "gpu_decode_ms": gpu_dec * 1e3,
            }
        )
    faster = [
        r["symbols"]
        for i, r in enumerate(rows)
        if all(
            s["gpu_encode_ms"] < s["cpu_encode_ms"] and s["gpu_decode_ms"] < s["cpu_decode_ms"]
            for s in rows[i:]
        )
    ]
    return {"rows": rows, "gpu_pays_from_symbols": faster[0] if faster else None}
