"""GPU checks for a lent machine: CPU/GPU byte identity, and the speed of the GPU paths.

    bash bench/gpu/check.sh [OUT_DIR]                # on a CUDA machine: one process a step
    python -m bench.gpu.check --out DIR [--only S,T]  # the steps in this process
    python -m bench.gpu.check --out DIR --cpu-dry-run  # the same code, tiny sizes, on CPU

Steps, cheapest and most wanted first (`STEPS`):

1. ``entropy_identity``: the CUDA entropy kernels against the numpy coder on random streams
   and K/V byte planes up to 16 M symbols, each decoding the other's (bench/gpu/entropy.py;
   the check CI runs on the kernel source without a GPU).
2. ``entropy_speed``: GB/s of the kernels (device-resident) and end to end, on 256 MB of bf16
   K/V byte planes, at the per-vector codecs' lane count, 4x more lanes and the default's.
3. ``entropy_crossover``: from which stream length the GPU beats numpy, host to host (the
   value for `seqkv_codecs.entropy.placement.GPU_MIN_SYMBOLS`).
4. ``files``: whole `.skv` files from `seqkv --device cpu` and `--device cuda` (portable path,
   `seq` trie/flat/--parallel and the per-vector `lossless` and `turbo3` with every entropy
   stream forced onto the GPU): byte-identical, each restored on the other device
   (bench/gpu/files.py).
5. ``portable``: the portable forward on CPU and device in one process: bits, times, rows of
   8 and 64 sessions (bench/gpu/portable.py).
6. ``tables``: token-coder frequency tables, numpy vs torch on the device.
7. ``canonical``: the legacy canonical forward on the device (row invariance, CPU logits).
8. ``files_many``: whole files of 64 sessions (batched rows), decode tokens/s.
9. ``token_coder``: 64 sessions of the token coder in lockstep on the device.

Writes gpu_check.md and gpu_check.json to --out after every step; with --only, the steps' results
are merged into what the folder already holds (gpu_check.sh runs one process per step, so a
crash or a CUDA error in one cannot take the others with it). The report ends with what to run
next.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch

from bench import harness
from bench.gpu.entropy import (
    Case,
    check,
    crossover,
    kv_planes,
    random_cases,
    speed,
    summary,
)
from bench.gpu.files import whole_files
from bench.gpu.portable import portable_forward
from bench.gpu.report import STEPS, markdown
from bench.gpu.tokens import SMOLLM2, TINY, DeviceRows, token_coder
from seqkv_codecs.entropy.stream import default_lanes
from seqkv_codecs.pervector._symbols import lanes_for


def _kernel_available() -> bool:
    """The CUDA kernels can run here: a GPU, or numba's simulator (a dry run's)."""
    from seqkv_codecs.entropy import rans_cuda

    return rans_cuda.available()


def entropy_identity(dry: bool) -> dict:
    """Random streams and K/V planes, the CUDA kernels against numpy, both ways; without a
    GPU (and without the simulator) the kernel source on the CPU (`rans_lanes_cpu`)."""
    from seqkv_codecs.entropy import rans_cuda, rans_lanes_cpu

    if dry:  # the simulator runs every GPU thread as a Python thread: tiny streams, 4 steps
        cases = [
            Case(c.name, c.symbols, c.alphabet, max(1, c.symbols.size // 4))
            for c in random_cases(40, seed=3, max_symbols=400)
            if c.symbols.size > 2 and c.symbols.size <= 400
        ][:3]
    else:
        cases = random_cases(300, seed=39, max_symbols=16 << 20)
        for name, plane in kv_planes(32.0, seed=5).items():  # 16 M symbols a plane
            cases.append(Case(name, plane, 256, lanes_for(plane.size)))
    per_thread = iter([None, 1, 2, 4, 8] * len(cases))
    if _kernel_available():
        kernel = "cuda"
        encode = lambda s, a, k: rans_cuda.encode_symbols_cuda(s, a, lanes=k)  # noqa: E731
        decode = lambda d: rans_cuda.decode_symbols_cuda(  # noqa: E731
            d, per_thread=next(per_thread)
        ).copy_to_host()
    else:
        kernel = "kernel source on the CPU (no CUDA, no simulator)"
        encode = rans_lanes_cpu.encode_symbols
        decode = lambda d: rans_lanes_cpu.decode_symbols(d, next(per_thread))  # noqa: E731
    rows = []
    before = rans_cuda.host_decodes
    for row in check(cases, encode, decode):
        rows.append(row)
        if row["failed"]:
            print(f"  entropy identity FAILED: {row}", flush=True)
    # streams with more lanes than the GPU holds at once go to numpy: not a kernel check
    return {"kernel": kernel, "decoded_on_cpu": rans_cuda.host_decodes - before, **summary(rows)}


def entropy_speed(dry: bool, mb: float) -> dict:
    """GB/s of the kernels on each byte plane of ``mb`` MB of bf16 K/V."""
    if not _kernel_available():
        return {"skipped": "no CUDA GPU (and not numba's simulator)"}
    rows = []
    for name, plane in kv_planes(mb).items():
        n = plane.size
        # the simulator: a few steps only; a GPU: the codecs' lanes (~1,024 steps), 4x more
        # lanes (~256 steps) and the entropy default's (16,384 lanes: ~n / 16,384 steps)
        configs = [n // 4] if dry else [lanes_for(n), n // 256, default_lanes(n)]
        for lanes in configs:
            rows.append({"plane": name, **speed(plane, lanes, repeat=1 if dry else 3)})
            print(f"  entropy speed {name} lanes={lanes}: {rows[-1]}", flush=True)
    return {"rows": rows}


def entropy_crossover(dry: bool) -> dict:
    if not _kernel_available():
        return {"skipped": "no CUDA GPU (and not numba's simulator)"}
    if dry:
        return crossover([64, 128], repeat=1, lanes_of=lambda n: n // 4)
    return crossover([1 << p for p in range(10, 25, 2)])


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


def run_step(name: str, args, dry: bool, device: str, shape: dict) -> object:
    mb = args.kv_mb or (0.004 if dry else 256.0)
    sessions, tokens = args.sessions or (4 if dry else 64), args.tokens or (8 if dry else 128)
    chars = 60 if dry else 400  # characters per session of the whole-file steps (byte tokens)
    if name == "entropy_identity":
        return entropy_identity(dry)
    if name == "entropy_speed":
        return entropy_speed(dry, mb)
    if name == "entropy_crossover":
        return entropy_crossover(dry)
    if name == "files":
        return whole_files(device, shape, (1,) if dry else (1, 8), chars)
    if name == "portable":
        return portable_forward(
            shape, device, 16 if dry else 256, 4 if dry else 24, (2,) if dry else (8, 64)
        )
    if name == "tables":
        return tables(DeviceRows(shape, "cpu"), device, 16 if dry else 256)
    if name == "canonical":
        return canonical_on_device(shape, device, 16 if dry else 256)
    if name == "files_many":
        return whole_files(device, shape, (2,) if dry else (64,), chars // 4)
    if name == "token_coder":
        return token_coder(shape, device, sessions, tokens)
    raise SystemExit(f"unknown step {name!r}; steps: {', '.join(STEPS)}")


def main(argv: list[str] | None = None) -> dict:
    # no --model: the model's shape is the embedded one's (or TINY's), weights random
    parser = harness.parser(__doc__, model=False)
    parser.add_argument("--out", type=Path, required=True, help="folder for the report")
    parser.add_argument("--cpu-dry-run", action="store_true", help="same code, tiny, on CPU")
    parser.add_argument("--only", help=f"comma-separated steps of: {', '.join(STEPS)}")
    parser.add_argument(
        "--record", metavar="STEP=MESSAGE", help="record a step that failed outside Python"
    )
    parser.add_argument("--kv-mb", type=float, help="MB of bf16 K/V for the entropy speed")
    parser.add_argument("--sessions", type=int, help="sessions decoded in lockstep")
    parser.add_argument("--tokens", type=int, help="tokens per session")
    args = parser.parse_args(argv)
    harness.start(args)
    dry = args.cpu_dry_run
    if not dry and not torch.cuda.is_available():
        raise SystemExit("CUDA is not available to this torch build; use --cpu-dry-run")
    device = "cpu" if dry else "cuda"
    shape = TINY if dry else SMOLLM2
    report_path = args.out / "gpu_check.json"
    merging = bool(args.only or args.record) and report_path.exists()
    report = json.loads(report_path.read_text()) if merging else {}
    report.update(
        environment=harness.environment(),
        command=harness.command_line(),
        mode="cpu dry run" if dry else "gpu",
        torch=torch.__version__,
        device_name=torch.cuda.get_device_name() if not dry else "cpu",
        cuda_matmul_allow_tf32=torch.backends.cuda.matmul.allow_tf32,
        model_shape=shape,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    if args.record:
        step, _, message = args.record.partition("=")
        report[step] = {"error": message}
        _write(args.out, report)
        return report
    steps = args.only.split(",") if args.only else list(STEPS)
    for name in steps:
        print(f"gpu_check: {name}", flush=True)
        start = time.perf_counter()
        try:
            report[name] = run_step(name, args, dry, device, shape)
        except Exception as exc:  # one failed step must not lose the others' results
            report[name] = {"error": f"{type(exc).__name__}: {exc}"[:600]}
            print(f"gpu_check: {name} failed: {report[name]['error']}", flush=True)
        report[f"{name}_seconds"] = time.perf_counter() - start
        _write(args.out, report)  # a run cut off by the device's time limit keeps both
    if args.only and not (args.json or args.append):
        return report  # one step of gpu_check.sh: the script prints the report's end once
    harness.publish(report, markdown(report), args.json, args.append)
    return report


def _write(out: Path, report: dict) -> None:
    harness.write_text(out / "gpu_check.json", json.dumps(report, indent=2))
    harness.write_text(out / "gpu_check.md", markdown(report))


if __name__ == "__main__":
    main()
