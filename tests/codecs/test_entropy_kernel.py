"""The GPU entropy kernel against the numpy coder, without a GPU.

* The kernel source (`entropy.lanes`) compiled for the CPU, in the GPU's thread geometry
  (`rans_lanes_cpu`), on >= 1,000 random streams and on every byte plane of real bf16 K/V:
  the same bytes as numpy, and each decodes the other's stream.
* The CUDA kernels themselves (`entropy.cuda_kernels`, launched by `rans_cuda`) under numba's
  CUDA simulator, on small streams (it runs every GPU thread as a Python thread): the histogram,
  the encode, the device compaction across several chunks, the cooperative decode with 1 to 8
  lanes a thread, the trivial streams, the range error and corrupt-stream detection.
* The kernels compiled to PTX for Hopper (sm_90) where a CUDA toolkit is present, and no
  register spills (ptxas).
* ``backend="auto"`` stays on numpy without a GPU, and falls back to it, saying so once, when
  the GPU coder cannot run.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
import textwrap
import time
import types
import warnings
from pathlib import Path

import numpy as np
import pytest

from bench.gpu.entropy import Case, bf16_planes, check, random_cases, summary
from seqkv_codecs.entropy import decode_symbols, encode_symbols, placement, rans_lanes_cpu
from seqkv_codecs.entropy.geometry import decode_geometry
from seqkv_codecs.errors import CorruptStreamError

ROOT = Path(__file__).resolve().parents[2]
STREAMS = 1024


def _replay_decoder():
    """rans_lanes_cpu's decoder, with 1, 2, 4, 8 lanes a thread and the GPU's own choice in
    turn (the lane-to-thread assignment changes the word offsets each thread computes)."""
    per_thread = itertools.cycle([None, 1, 2, 4, 8])
    return lambda data: rans_lanes_cpu.decode_symbols(data, next(per_thread))


def test_kernel_source_matches_numpy_on_random_streams():
    start = time.perf_counter()
    cases = random_cases(STREAMS, seed=39)
    result = summary(list(check(cases, rans_lanes_cpu.encode_symbols, _replay_decoder())))
    assert result["failures"] == []
    assert result["identical"] == result["streams"] == STREAMS
    assert result["largest"] > 2_000_000  # MB-sized streams are in the draw
    kinds = {c.name.split("-")[2] for c in cases}
    assert kinds == {"flat", "geometric", "zipf", "sparse", "few", "bf16"}
    assert {c.alphabet for c in cases} >= {2, 256, 4097, 65_536}
    print(f"{STREAMS} streams, {result['symbols']:,} symbols: {time.perf_counter() - start:.1f} s")


@pytest.mark.model
def test_kernel_source_matches_numpy_on_real_bf16_kv(embedded_lm):
    """Every byte plane of every layer's K and V of the embedded model on sample prose, and of
    the whole cache (bf16, as captures store it)."""
    import torch

    text = (ROOT / "sample_data" / "prose.txt").read_text(encoding="utf-8")
    ids = embedded_lm.tokenizer(text, return_tensors="pt").input_ids[:, :192]
    with torch.inference_mode():
        cache = embedded_lm.model(ids, use_cache=True).past_key_values
    cases, whole = [], {"key": [], "value": []}
    for i, layer in enumerate(cache.layers):
        for kind, t in (("key", layer.keys), ("value", layer.values)):
            bits = t.bfloat16().view(torch.int16).numpy().view(np.uint16)
            cases += bf16_planes(f"layer{i}-{kind}", bits)
            whole[kind].append(bits.reshape(-1))
    for kind, parts in whole.items():
        planes = bf16_planes(f"cache-{kind}", np.concatenate(parts))
        cases += planes + [Case(c.name + "-default-lanes", c.symbols, 256) for c in planes]
    assert len(cases) == 30 * 2 * 2 + 8
    result = summary(list(check(cases, rans_lanes_cpu.encode_symbols, _replay_decoder())))
    assert result["failures"] == []
    assert result["identical"] == len(cases)


def test_decode_geometry():
    assert decode_geometry(1, lambda t: 1).per_thread == 1
    g = decode_geometry(100_000, lambda threads: 132 * 2048 // threads)
    assert (g.threads, g.per_thread, g.blocks) == (256, 1, 391)
    g = decode_geometry(1_000_000, lambda threads: 132 * 2048 // threads)
    assert (g.threads, g.per_thread, g.blocks) == (256, 4, 977)
    assert decode_geometry(1_000_000, lambda t: 1) is None  # the simulator holds one block
    assert decode_geometry(2048, lambda t: 1) == decode_geometry(2048, lambda t: 1, 8)
    g = decode_geometry(200, lambda t: 1, per_thread=8)
    assert (g.threads, g.per_thread, g.blocks) == (32, 8, 1)  # 25 threads' worth of lanes
    g = decode_geometry(500, lambda t: 1)
    assert (g.threads, g.per_thread, g.blocks) == (256, 2, 1)
    g = decode_geometry(1250, lambda t: 1)
    assert (g.threads, g.per_thread, g.blocks) == (160, 8, 1)
    g = decode_geometry(70, lambda t: 4)
    assert (g.threads, g.per_thread, g.blocks) == (96, 1, 1)


SIMULATED = textwrap.dedent(
    """
    import numpy as np
    from numba import cuda
    from seqkv_codecs.entropy import decode_symbols, encode_symbols, rans_cuda
    from seqkv_codecs.errors import CorruptStreamError

    from numba.core import config

    assert config.ENABLE_CUDASIM  # the kernels below run in numba's simulator

    def no_fallback(parsed):
        raise AssertionError("the decode fell back to the CPU: its grid did not fit")

    rans_cuda._decode_on_host = no_fallback
    rng = np.random.default_rng(7)
    geometric = lambda n, p, a: np.minimum(rng.geometric(p, n) - 1, a - 1)
    cases = [  # (symbols, alphabet, lanes, lanes per decode thread)
        (geometric(5000, 0.3, 256).astype(np.uint8), 256, 1250, None),  # 3 chunks, 8 a thread
        (np.minimum(rng.zipf(1.3, 3000) - 1, 65535).astype(np.uint16), 65536, 1000, None),
        (rng.integers(0, 5, 700).astype(np.uint8), 5, 200, 2),
        (rng.integers(0, 2, 129).astype(np.uint8), 2, 33, 1),  # ragged last step
        (geometric(600, 0.05, 4097).astype(np.uint16), 4097, 150, 4),
        (np.zeros(0, np.uint8), 7, None, None),
        (np.full(1000, 6, np.uint8), 7, None, None),  # one symbol: no lanes, the fill kernel
    ]
    for i, (sym, alphabet, lanes, per_thread) in enumerate(cases):
        cpu = encode_symbols(sym, alphabet, lanes=lanes)
        gpu = rans_cuda.encode_symbols_cuda(sym, alphabet, lanes=lanes, threads=32)
        assert gpu == cpu, f"case {i}: bytes differ"
        assert np.array_equal(decode_symbols(gpu), sym), f"case {i}: numpy decode"
        out = rans_cuda.decode_symbols_cuda(cpu, per_thread=per_thread).copy_to_host()
        assert out.dtype == sym.dtype and np.array_equal(out, sym), f"case {i}: kernel decode"
        print("case", i, "identical")

    # a torch-style device array in: numba's own device array of the symbols
    sym = cases[0][0]
    assert rans_cuda.encode_symbols_cuda(cuda.to_device(sym), 256, lanes=1250) == \\
        encode_symbols(sym, 256, lanes=1250)
    try:
        rans_cuda.encode_symbols_cuda(np.array([1, 2, 9], np.uint8), 5, threads=32)
        raise AssertionError("a symbol outside the alphabet was coded")
    except ValueError as exc:
        assert "found values in [1, 9]" in str(exc), exc
    # corrupt streams: the kernel's end checks catch what numpy's catch
    data = encode_symbols(cases[3][0], 2, lanes=33)
    n_words = int.from_bytes(data[24:32], "little")
    lanes_at = len(data) - 2 * n_words - 4 * 33
    for at, value, size in ((len(data) - 2, 0x1234, 2), (lanes_at + 4, 0x7FFFFFFF, 4)):
        bad = data[:at] + value.to_bytes(size, "little") + data[at + size:]
        for decode in (decode_symbols, lambda d: rans_cuda.decode_symbols_cuda(d).copy_to_host()):
            try:
                decode(bad)
                raise AssertionError(f"tampered byte {at} decoded")
            except CorruptStreamError:
                pass
    print("simulated kernels: all identical")
    """
)


def test_cuda_kernels_under_the_simulator():
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "codecs")])
    done = subprocess.run(
        [sys.executable, "-c", SIMULATED], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "simulated kernels: all identical" in done.stdout
    assert done.stdout.count("identical") == 8


def _nvvm() -> bool:
    cuda_home = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"))
    return (cuda_home / "nvvm" / "libdevice").is_dir() and (cuda_home / "lib64").is_dir()


@pytest.mark.skipif(not _nvvm(), reason="no CUDA toolkit (NVVM) to compile the kernels with")
def test_cuda_kernels_compile_for_hopper(tmp_path):
    """What the simulator cannot show: the kernels type-check for the real CUDA target. numba
    compiles device functions for the current device's architecture, and there is none here:
    its lookup is pointed at sm_90 for this test."""
    from numba.cuda import dispatcher
    from numba.cuda.compiler import compile_ptx

    from seqkv_codecs.entropy import cuda_kernels as source

    signatures = {
        "histogram": "uint8[::1], int64, int64, int64[::1], int64[::1]",
        "encode": "uint16[::1], int64, int64, int64[::1], int64, int64, uint8[::1], "
        "uint16[::1], int64[::1]",
        "count": "uint8[::1], int64, int64, int64[::1]",
        "scan": "int64[::1], int64, int64[::1]",
        "scatter": "uint8[::1], uint16[::1], int64, int64, int64[::1], uint16[::1]",
        "fill": "uint16[::1], int64, int64",
        "decode": source.DECODE_SIGNATURE.replace("S", "uint8"),
    }
    hopper = types.SimpleNamespace(compute_capability=(9, 0))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dispatcher, "get_current_device", lambda: hopper)
        ptx = {
            k: compile_ptx(getattr(source, k), sig, cc=(9, 0))[0] for k, sig in signatures.items()
        }
    assert "cudaCGSynchronize" in ptx["decode"]  # the grid barrier: a cooperative launch
    ptxas = shutil.which("ptxas") or "/usr/local/cuda/bin/ptxas"
    if not Path(ptxas).exists():
        return
    for name, code in ptx.items():
        path = tmp_path / f"{name}.ptx"
        path.write_text(code)
        done = subprocess.run(
            [ptxas, "-arch=sm_90", "-v", "-c", str(path), "-o", os.devnull],
            capture_output=True, text=True,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert "0 bytes spill stores" in done.stderr, (name, done.stderr)


def test_auto_stays_on_numpy_without_a_gpu():
    symbols = np.random.default_rng(0).integers(0, 200, 5000).astype(np.uint8)
    data = encode_symbols(symbols, 200)
    with placement.on_device("cpu"):
        assert placement.backend_for(1 << 30) == "numpy"
        assert encode_symbols(symbols, 200, backend="auto") == data
    assert placement.device() == "cpu"
    with placement.on_device("cuda:1"):
        assert placement.device() == "cuda:1"
        assert placement.backend_for(10) == "numpy"  # below the crossover
    with pytest.raises(ValueError, match="cpu, cuda or cuda:N"):
        placement.use_device("tpu")
    with pytest.raises(ValueError, match="'auto' follows"):
        decode_symbols(data, backend="auto", device="cuda")


def test_auto_falls_back_to_numpy_once_when_the_gpu_cannot_run(monkeypatch):
    from seqkv_codecs.entropy import rans_cuda

    def broken(*args, **kwargs):
        raise RuntimeError("NVVM not found")

    monkeypatch.setattr(placement, "_gpu_failed", None)
    monkeypatch.setattr(rans_cuda, "available", lambda: True)
    monkeypatch.setattr(rans_cuda, "encode_symbols_cuda", broken)
    monkeypatch.setattr(rans_cuda, "decode_symbols_cuda", broken)
    monkeypatch.setenv(placement.ENV_MIN_SYMBOLS, "0")
    symbols = np.random.default_rng(1).integers(0, 9, 3000).astype(np.uint8)
    data = encode_symbols(symbols, 9)
    with placement.on_device("cuda"):
        assert placement.backend_for(1) == "cuda"
        with pytest.warns(RuntimeWarning, match="stays on the CPU: RuntimeError: NVVM"):
            assert encode_symbols(symbols, 9, backend="auto") == data
        assert placement.backend_for(1 << 30) == "numpy"  # remembered for the process
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # said once only
            np.testing.assert_array_equal(decode_symbols(data, backend="auto"), symbols)
    # a corrupt stream is corrupt wherever it is decoded: not a reason to change device
    monkeypatch.setattr(placement, "_gpu_failed", None)
    monkeypatch.setattr(
        rans_cuda, "decode_symbols_cuda", lambda *a, **k: (_ for _ in ()).throw(
            CorruptStreamError("rANS stream ran out of words"))
    )  # fmt: skip
    with placement.on_device("cuda"), pytest.raises(CorruptStreamError, match="ran out"):
        decode_symbols(data, backend="auto")
    assert placement.backend_for(1) == "numpy"  # device is cpu again outside the block


def test_gpu_threshold_from_the_environment(monkeypatch):
    monkeypatch.delenv(placement.ENV_MIN_SYMBOLS, raising=False)
    assert placement.gpu_min_symbols() == placement.GPU_MIN_SYMBOLS
    monkeypatch.setenv(placement.ENV_MIN_SYMBOLS, "4096")
    assert placement.gpu_min_symbols() == 4096
    monkeypatch.setenv(placement.ENV_MIN_SYMBOLS, "lots")
    assert placement.gpu_min_symbols() == placement.GPU_MIN_SYMBOLS


def test_per_vector_streams_unchanged_by_auto():
    """`pack_symbols` now asks for "auto": on a CPU its sections are the numpy coder's."""
    from seqkv_codecs.framing import StreamReader
    from seqkv_codecs.pervector._symbols import lanes_for, pack_symbols, unpack_symbols

    symbols = np.random.default_rng(2).integers(0, 132, 70_000).astype(np.uint8)
    packed = pack_symbols(symbols, 132)
    assert packed[4:] == encode_symbols(symbols, 132, lanes=lanes_for(70_000))
    reader = StreamReader(packed, "test")
    np.testing.assert_array_equal(unpack_symbols(reader, 70_000, 132, "test"), symbols)


def test_corrupt_streams_rejected_by_the_kernel_source():
    symbols = np.random.default_rng(3).integers(0, 40, 4000).astype(np.uint8)
    data = encode_symbols(symbols, 40, lanes=64)
    n_words = int.from_bytes(data[24:32], "little")
    lanes_at = len(data) - 2 * n_words - 4 * 64
    for at, value, size in ((len(data) - 2, 0x1234, 2), (lanes_at + 8, 0x7FFF0000, 4)):
        bad = data[:at] + value.to_bytes(size, "little") + data[at + size :]
        with pytest.raises(CorruptStreamError):
            decode_symbols(bad)
        with pytest.raises(CorruptStreamError):
            rans_lanes_cpu.decode_symbols(bad)
