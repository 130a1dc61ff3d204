"""GPU checks for a lent machine: CPU/GPU byte identity, and the speed of the GPU paths.

    python -m bench.gpu_check --out DIR              # on a CUDA machine (bench/gpu_check.sh)
    python -m bench.gpu_check --out DIR --cpu-dry-run  # the same code, tiny sizes, on CPU

1. Entropy coder: numpy (CPU) vs torch-on-device bytes for the same symbols and lanes, both
   decoders on both streams, and device encode/decode GB/s on >= 256 MB of bf16 K/V.
2. Token-coder tables: `frequencies_from_logits` (numpy, CPU) vs `frequencies_from_logits_torch`
   on device tensors, on model logits and on edge cases (ties, -inf, peaked rows).
3. Canonical forward on the device: is a row of a row-block-padded product independent of
   the other rows (the CPU canary, on device), and do device logits equal CPU logits?
4. Token coder tokens/s with >= 64 sessions decoded in lockstep on the device.
4b. The portable forward (bench/gpu_portable.py): CPU vs device bits of a prefill and steps,
   their times, rows of 8 and 64 sessions, and a transformers fp32 step on the device.
5. Whole `.skv` files (bench/gpu_files.py): the `seqkv` command with --device cpu and cuda on
   1, 8 and 32 sessions — byte-identical files, cross-device restores, decode tokens/s.
Writes gpu_check.md and gpu_check.json to --out.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch

from bench import harness
from bench.gpu_files import whole_files
from bench.gpu_portable import portable_forward
from bench.gpu_report import markdown
from bench.gpu_tokens import SMOLLM2, TINY, DeviceRows, token_coder


def kv_planes(mb: float, seed: int = 0) -> dict[str, np.ndarray]:
    """High and low byte planes of `mb` MB of bf16 values shaped like K/V (per-channel scale)."""
    n = int(mb * 1e6) // 2
    rng = np.random.default_rng(seed)
    scale = np.exp(rng.normal(0.0, 1.5, 64)).astype(np.float32)
    values = rng.standard_normal((n // 64 + 1, 64), dtype=np.float32) * scale
    codes = (values.reshape(-1)[:n].view(np.uint32) >> 16).astype(np.uint16)
    return {"kv-high-byte": (codes >> 8).astype(np.uint8), "kv-low-byte": codes.astype(np.uint8)}


def _best(fn, repeat: int = 3) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeat):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def entropy(device: str, mb: float) -> list[dict]:
    from seqkv_codecs.entropy.stream import default_lanes

    rows = []
    for name, sym in kv_planes(mb).items():
        on_dev = torch.from_numpy(sym).to(device)
        for lanes in sorted({default_lanes(sym.size), max(sym.size // 256, 1)}):
            rows.append({"plane": name, **_plane(sym, on_dev, lanes, device)})
            print(f"  entropy {name} lanes={lanes} done", flush=True)
    return rows


def _plane(sym: np.ndarray, on_dev: torch.Tensor, lanes: int, device: str) -> dict:
    """One byte plane through both backends: identical bytes, cross decodes, device speed."""
    from seqkv_codecs.entropy import (
        decode_symbols,
        decode_symbols_torch,
        encode_symbols,
        encode_symbols_torch,
    )

    def dev_decode(data: bytes) -> torch.Tensor:
        out = decode_symbols_torch(data, device)
        if out.is_cuda:
            torch.cuda.synchronize()
        return out

    cpu_s, cpu_blob = _best(lambda: encode_symbols(sym, 256, lanes=lanes), 1)
    enc_s, blob = _best(lambda: encode_symbols_torch(on_dev, 256, lanes=lanes))
    dec_s, back = _best(lambda: dev_decode(blob))
    return {
        "symbols": int(sym.size),
        "lanes": lanes,
        "bits_per_symbol": len(blob) * 8 / sym.size,
        "bytes_identical": blob == cpu_blob,
        "device_decodes_cpu_stream": bool(np.array_equal(dev_decode(cpu_blob).cpu().numpy(), sym)),
        "cpu_decodes_device_stream": bool(np.array_equal(decode_symbols(blob), sym)),
        "device_round_trip": bool(np.array_equal(back.cpu().numpy(), sym)),
        "cpu_numpy_encode_GBps": sym.size / cpu_s / 1e9,
        "device_encode_GBps": sym.size / enc_s / 1e9,
        "device_decode_GBps": sym.size / dec_s / 1e9,
    }


def tables(model: DeviceRows, device: str, rows: int) -> list[dict]:
    """numpy (CPU) vs torch-on-device frequency tables, on model and edge-case logits."""
    from seqkv_codecs.sequential import frequencies_from_logits, frequencies_from_logits_torch

    rng = np.random.default_rng(1)
    ids = rng.integers(0, model.vocab_size, rows)
    model_logits = model.feed(model.start(rows), ids)
    edge = rng.standard_normal((64, model.vocab_size)).astype(np.float32) * 4
    edge[::4, : model.vocab_size // 2] = -np.inf  # masked tokens
    edge[1::4] = np.round(edge[1::4])  # many ties, including ties for the top
    edge[2::4, 7] += 60.0  # one very confident token
    out = []
    for name, logits in (("model logits", model_logits), ("edge cases", edge)):
        for precision in (16, 24, 31):
            cpu = frequencies_from_logits(logits, precision)
            dev = frequencies_from_logits_torch(torch.from_numpy(logits).to(device), precision)
            out.append(
                {
                    "logits": name,
                    "rows": int(logits.shape[0]),
                    "precision_bits": precision,
                    "identical": bool(np.array_equal(cpu, dev.cpu().numpy())),
                }
            )
    return out


def canonical_on_device(shape: dict, device: str, tokens: int) -> dict:
    """Row invariance of padded products on the device, and device vs CPU logits."""
    import torch.nn.functional as F

    dev = torch.device(device)
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(3 * 576, 576, generator=gen).to(dev)
    x = torch.randn(64, 576, generator=gen).to(dev)
    full = F.linear(x, w)
    pieces = ((0, 8), (8, 16), (24, 8), (40, 24))
    invariant = all(torch.equal(F.linear(x[s : s + n], w), full[s : s + n]) for s, n in pieces)
    ids = np.random.default_rng(2).integers(0, shape["vocab"], tokens)
    cpu, on_dev = DeviceRows(shape, "cpu"), DeviceRows(shape, device)
    a = cpu.feed(cpu.start(tokens), ids)
    b = on_dev.feed(on_dev.start(tokens), ids)
    return {
        "row_invariant_products": invariant,
        "tokens": tokens,
        "logits_bit_identical_to_cpu": bool(np.array_equal(a.view(np.uint32), b.view(np.uint32))),
        "logits_elements_equal": float((a == b).mean()),
        "logits_max_abs_diff": float(np.abs(a - b).max()),
    }


def main(argv: list[str] | None = None) -> dict:
    # no --model: the model's shape is the embedded one's (or TINY's), weights random
    parser = harness.parser(__doc__, model=False)
    parser.add_argument("--out", type=Path, required=True, help="folder for the report")
    parser.add_argument("--cpu-dry-run", action="store_true", help="same code, tiny, on CPU")
    parser.add_argument("--kv-mb", type=float, help="MB of bf16 K/V for the entropy coder")
    parser.add_argument("--sessions", type=int, help="sessions decoded in lockstep")
    parser.add_argument("--tokens", type=int, help="tokens per session")
    args = parser.parse_args(argv)
    harness.start(args)
    dry = args.cpu_dry_run
    if not dry and not torch.cuda.is_available():
        raise SystemExit("CUDA is not available to this torch build; use --cpu-dry-run")
    device = "cpu" if dry else "cuda"
    shape = TINY if dry else SMOLLM2
    mb = args.kv_mb or (2.0 if dry else 256.0)
    sessions, tokens = args.sessions or (4 if dry else 64), args.tokens or (8 if dry else 128)
    chars = 60 if dry else 400  # characters per session of the whole-file step (byte tokens)
    report = {
        "environment": harness.environment(),
        "command": harness.command_line(),
        "mode": "cpu dry run" if dry else "gpu",
        "torch": torch.__version__,
        "device_name": torch.cuda.get_device_name() if not dry else "cpu",
        "cuda_matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "model_shape": shape,
    }
    # Cheap steps first, the whole-file ones last and in two parts: a run cut off by the
    # device's time limit keeps what finished (both reports are rewritten after each step).
    steps = [
        ("entropy", lambda: entropy(device, mb)),
        ("tables", lambda: tables(DeviceRows(shape, "cpu"), device, 16 if dry else 256)),
        (
            "portable",
            lambda: portable_forward(
                shape, device, 16 if dry else 256, 4 if dry else 24, (2,) if dry else (8, 64)
            ),
        ),
        ("files", lambda: whole_files(device, shape, (1,) if dry else (1, 8), chars)),
        ("canonical", lambda: canonical_on_device(shape, device, 16 if dry else 256)),
        ("token_coder", lambda: token_coder(shape, device, sessions, tokens)),
        ("files_many", lambda: whole_files(device, shape, (2,) if dry else (32,), chars)),
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    for name, step in steps:
        print(f"gpu_check: {name}", flush=True)
        start = time.perf_counter()
        try:
            report[name] = step()
        except Exception as exc:  # one failed step must not lose the others' results
            report[name] = {"error": f"{type(exc).__name__}: {exc}"[:600]}
            print(f"gpu_check: {name} failed: {report[name]['error']}", flush=True)
        report[f"{name}_seconds"] = time.perf_counter() - start
        harness.write_text(args.out / "gpu_check.json", json.dumps(report, indent=2))
        harness.write_text(args.out / "gpu_check.md", markdown(report))  # a cut-off run keeps both
    harness.publish(report, markdown(report), args.json, args.append)
    return report


if __name__ == "__main__":
    main()
