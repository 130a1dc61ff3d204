"""Throughput and ratio of the seqkv rANS coder against zstandard, on KV-like byte planes.

    OMP_NUM_THREADS=1 python -m bench.studies.entropy --size-mb 16 --json out/bench_entropy.json

Every method round-trips every input (checked); MB/s counts input symbols (one byte each), best
of ``--repeat`` runs, one thread. ``--kv FILE`` takes the byte planes from a bf16 safetensors
file instead of synthetic Gaussian bf16 values.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import zstandard

from bench import harness
from bench.table import table
from seqkv_codecs.entropy import (
    decode_symbols,
    decode_symbols_torch,
    encode_symbols,
    encode_symbols_torch,
)


def datasets(n: int, kv_file: str | None) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    if kv_file:
        from safetensors.torch import load_file

        tensors = [t for t in load_file(kv_file).values() if t.dtype == torch.bfloat16]
        codes = torch.cat([t.reshape(-1) for t in tensors]).view(torch.int16).numpy()
        codes = np.resize(codes.view(np.uint16), n)
    else:  # Gaussian values with log-normal per-channel scales, truncated to bf16
        scale = np.exp(rng.normal(0.0, 1.5, 64)).astype(np.float32)
        values = rng.standard_normal((n // 64 + 1, 64)).astype(np.float32) * scale
        codes = (values.reshape(-1)[:n].view(np.uint32) >> 16).astype(np.uint16)
    return {
        "kv-high-byte": (codes >> 8).astype(np.uint8),
        "kv-low-byte": (codes & 0xFF).astype(np.uint8),
        "skewed-geometric": np.minimum(rng.geometric(0.25, n) - 1, 255).astype(np.uint8),
    }


def methods() -> dict[str, tuple[Callable, Callable]]:
    found = {
        "rans-numpy": (lambda a: encode_symbols(a, 256), decode_symbols),
        "rans-torch-cpu": (
            lambda a: encode_symbols_torch(torch.from_numpy(a), 256),
            lambda b: decode_symbols_torch(b, "cpu").numpy(),
        ),
    }
    if torch.cuda.is_available():

        def cuda_encode(a: np.ndarray) -> bytes:
            return encode_symbols_torch(torch.from_numpy(a).cuda(), 256)

        def cuda_decode(b: bytes) -> np.ndarray:
            out = decode_symbols_torch(b, "cuda")
            torch.cuda.synchronize()
            return out.cpu().numpy()

        found["rans-torch-cuda"] = (cuda_encode, cuda_decode)
    for level in (3, 19):
        found[f"zstd-{level}"] = (
            lambda a, lv=level: zstandard.ZstdCompressor(level=lv).compress(a.tobytes()),
            lambda b: np.frombuffer(zstandard.ZstdDecompressor().decompress(b), np.uint8),
        )
    return found


def run(size_mb: float, repeat: int, kv_file: str | None) -> list[dict]:
    n = int(size_mb * (1 << 20))
    rows = []
    for data_name, symbols in datasets(n, kv_file).items():
        counts = np.bincount(symbols, minlength=256)
        p = counts[counts > 0] / n
        entropy = float(-(p * np.log2(p)).sum())
        for name, (encode, decode) in methods().items():
            blob, t_enc = harness.best_of(lambda e=encode, a=symbols: e(a), repeat)
            back, t_dec = harness.best_of(lambda d=decode, b=blob: d(b), repeat)
            if not np.array_equal(back, symbols):
                raise SystemExit(f"{name} failed to round-trip {data_name}")
            rows.append(
                {
                    "data": data_name,
                    "method": name,
                    "symbols": n,
                    "entropy_bits": round(entropy, 4),
                    "bits_per_symbol": round(len(blob) * 8 / n, 4),
                    "ratio": round(n / len(blob), 4),
                    "encode_MBps": round(n / t_enc / 1e6, 1),
                    "decode_MBps": round(n / t_dec / 1e6, 1),
                }
            )
            print(f"  {data_name:17s} {name:16s} done", flush=True)
    return rows


def markdown(rows: list[dict]) -> str:
    head = [
        "data", "method", "entropy (bits)", "bits/symbol", "ratio", "encode MB/s", "decode MB/s"
    ]  # fmt: skip
    cells = [
        [r["data"], r["method"], f"{r['entropy_bits']:.3f}", f"{r['bits_per_symbol']:.3f}",
         f"{r['ratio']:.3f}", f"{r['encode_MBps']:.1f}", f"{r['decode_MBps']:.1f}"]
        for r in rows
    ]  # fmt: skip
    return "\n".join(table(head, cells, align="llrrrrr"))


def main(argv: list[str] | None = None) -> dict:
    parser = harness.parser(__doc__, threads=1, model=False)
    parser.add_argument("--size-mb", type=float, default=16.0, help="symbols per dataset, in MiB")
    parser.add_argument("--repeat", type=int, default=2, help="runs per measurement (best kept)")
    parser.add_argument("--kv", help="bf16 safetensors file to take real KV byte planes from")
    args = parser.parse_args(argv)
    harness.start(args)
    rows = run(args.size_mb, args.repeat, args.kv)
    return harness.finish(args, None, _report, size_mb=args.size_mb, results=rows)


def _report(result: dict) -> str:
    title = "The entropy coder against zstandard"
    return "\n".join([*harness.heading(title, result), markdown(result["results"])]) + "\n"


if __name__ == "__main__":
    main()
