"""The exact step against llama.cpp: a one-session `seq` restore of the same tokens of the same
GGUF, whole processes, on the models users download.

For each model (the embedded SmolLM2-135M Q4_1 GGUF, or GGUFs at real shapes with random
weights: `bench.real_shapes` writes an F16 file and llama.cpp's own quantizer makes Q4_K_M
of it — its real mix of kinds: Q4_K, Q6_K for some FFN rows and the output, Q5_0/Q8_0 where
a width is not a multiple of 256 — or Q8_0), one process a step, in order:

    capture        `seqkv capture` of the text (portable numerics)
    compress       `seqkv compress --codec seq` (coding, then a verifying restore)
    decompress     `seqkv decompress`: the `seq` restore, compared with the capture bit for bit
    llamacpp_step  llama.cpp (llama-cpp-python, the `llamacpp` extra): load, then the same
                   tokens one `llama_decode` each (n_batch 1), the same threads
    llamacpp_prefill  the same tokens in batches of 512 (what a capture is compared with)
    hf_step_loop   transformers fp32, one forward a token over the same tokens

Reported: seconds and peak RSS of each, the restore against llama.cpp's step, the capture
against its prefill, and the restore's milliseconds a token beside the fp64-FMA floor of the
model's multiply-adds (2 cores x 4 lanes x 2 ports at the machine's clock).

    python -m bench.studies.exact_step --models embedded,qwen2.5-0.5b:Q4_K_M --tokens 1000 \\
        --json bench/results/exact_step.json --append docs/BENCHMARKS_LOG.md
"""

from __future__ import annotations

import ctypes
import os
import sys
import tempfile
from pathlib import Path

from bench import harness
from bench.studies.real_models import run as run_seqkv
from bench.studies.real_models import timed_process

STEPS = ("capture", "compress", "decompress", "llamacpp_step", "llamacpp_prefill", "hf_step_loop")

PYTHON_LLAMACPP = """
import sys
import llama_cpp
from seqkv_cli.kvcapture.capture_file import load_capture
ids = [int(t) for t in load_capture({capture!r}).tokens]
llm = llama_cpp.Llama({gguf!r}, n_ctx={ctx}, n_batch={batch}, n_ubatch={batch},
                      n_threads={threads}, n_threads_batch={threads}, verbose=False)
llm.eval(ids)
"""


def make_gguf(spec: str, folder: Path) -> Path:
    """``embedded``, a .gguf file, or ``SHAPE:QUANT`` (a `bench.real_shapes` shape; Q4_K_M
    through llama.cpp's quantizer from an F16 file, Q8_0 written directly)."""
    if spec == "embedded":
        from seqkv_cli.runtime.embedded import embedded_gguf

        return embedded_gguf()
    if spec.endswith(".gguf"):
        return Path(spec)
    from bench.real_shapes import write_gguf

    shape, quant = spec.split(":")
    out = folder / f"{shape}-{quant}.gguf"
    if quant == "Q8_0":
        return write_gguf(shape, out, qtype="Q8_0")
    import llama_cpp

    f16 = write_gguf(shape, folder / f"{shape}-f16.gguf", qtype="F16")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{quant}")
    params.nthread = os.cpu_count() or 1
    if llama_cpp.llama_model_quantize(str(f16).encode(), str(out).encode(), ctypes.byref(params)):
        raise SystemExit(f"llama.cpp could not quantize {f16} to {quant}")
    f16.unlink()
    return out


def multiply_adds(gguf: Path) -> int:
    """Multiply-adds of one token's products: every 2-D weight once, the output (or the tied
    embedding) included, the embedding lookup not."""
    import gguf as gg

    reader = gg.GGUFReader(gguf)
    names = {t.name for t in reader.tensors}
    total = 0
    for t in reader.tensors:
        if len(t.shape) != 2:
            continue
        if t.name == "token_embd.weight" and "output.weight" in names:
            continue
        total += int(t.shape[0]) * int(t.shape[1])
    return total


def clock_hz() -> float:
    """The CPU's clock as the kernel reports it (the first 'cpu MHz' line), else 3 GHz."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("cpu MHz"):
                return float(line.split(":")[1]) * 1e6
    except OSError:
        pass
    return 3e9


def measure(spec: str, tokens: int, threads: int, steps: tuple[str, ...], folder: Path) -> dict:
    gguf = make_gguf(spec, folder)
    ours = tuple(s for s in ("capture", "compress", "decompress", "hf_step_loop") if s in steps)
    rows = run_seqkv(str(gguf), tokens, ("capture", *ours), folder)
    cap = folder / "cap.safetensors"
    for step, batch in (("llamacpp_step", 1), ("llamacpp_prefill", 512)):
        if step in steps:
            code = PYTHON_LLAMACPP.format(
                capture=str(cap), gguf=str(gguf), ctx=tokens + 64, batch=batch, threads=threads
            )
            rows[step] = timed_process([sys.executable, "-c", code], folder)
            print(step, rows[step], flush=True)
    from seqkv_cli.kvcapture.capture_file import load_capture

    n = int(load_capture(cap).tokens.shape[0])
    macs = multiply_adds(gguf)
    floor_ms = macs / (2 * 4 * 2 * clock_hz()) * 1e3
    out = {"model": spec, "gguf_bytes": gguf.stat().st_size, "tokens": n, "steps": rows}
    out["multiply_adds"] = macs
    out["fma_floor_ms_a_token"] = round(floor_ms, 2)
    if "decompress" in rows:
        out["restore_ms_a_token"] = round(rows["decompress"]["seconds"] / n * 1e3, 1)
    if "decompress" in rows and "llamacpp_step" in rows:
        out["restore_vs_llamacpp_step"] = round(
            rows["decompress"]["seconds"] / rows["llamacpp_step"]["seconds"], 2
        )
        out["llamacpp_ms_a_token"] = round(rows["llamacpp_step"]["seconds"] / n * 1e3, 1)
    if "capture" in rows and "llamacpp_prefill" in rows:
        out["capture_vs_llamacpp_prefill"] = round(
            rows["capture"]["seconds"] / rows["llamacpp_prefill"]["seconds"], 2
        )
    if "decompress" in rows and "hf_step_loop" in rows:
        out["hf_step_loop_vs_restore"] = round(
            rows["hf_step_loop"]["seconds"] / rows["decompress"]["seconds"], 2
        )
    return out


def markdown(result: dict) -> str:
    tokens = result["models"][0]["tokens"] if result["models"] else 0
    lines = harness.heading(f"The exact step against llama.cpp, {tokens:,} tokens", result)
    lines += [
        "| model | capture s | compress s | restore s (bit-exact) | llama.cpp step s | "
        "llama.cpp prefill s | transformers step loop s | restore / llama.cpp step | "
        "capture / llama.cpp prefill | ms a token: restore, llama.cpp, FMA floor | "
        "peak RSS GiB: restore, llama.cpp |",
        "|---|" + "---:|" * 10,
    ]
    for m in result["models"]:
        s = m["steps"]

        def sec(step, s=s):
            return f"{s[step]['seconds']:.1f}" if step in s else "-"

        exact = {True: "yes", False: "**no**"}.get(s.get("decompress", {}).get("bit_exact"), "")
        lines.append(
            f"| {m['model']} | {sec('capture')} | {sec('compress')} | {sec('decompress')} "
            f"({exact}) | {sec('llamacpp_step')} | {sec('llamacpp_prefill')} | "
            f"{sec('hf_step_loop')} | {m.get('restore_vs_llamacpp_step', '-')} | "
            f"{m.get('capture_vs_llamacpp_prefill', '-')} | {m.get('restore_ms_a_token', '-')}, "
            f"{m.get('llamacpp_ms_a_token', '-')}, {m['fma_floor_ms_a_token']} | "
            f"{s.get('decompress', {}).get('peak_GiB', '-')}, "
            f"{s.get('llamacpp_step', {}).get('peak_GiB', '-')} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = harness.parser(__doc__, threads=2, model=False)
    p.add_argument(
        "--models", default="embedded", help="comma-separated: embedded, FILE.gguf, SHAPE:QUANT"
    )
    p.add_argument("--tokens", type=int, default=1000)
    p.add_argument("--steps", default=",".join(STEPS), help="comma-separated steps to run")
    args = p.parse_args(argv)
    steps = tuple(s for s in args.steps.split(",") if s)
    unknown = set(steps) - set(STEPS)
    if unknown:
        raise SystemExit(f"unknown steps {sorted(unknown)}; choose from {', '.join(STEPS)}")
    harness.start(args, load=False)
    results = []
    for spec in args.models.split(","):
        with tempfile.TemporaryDirectory(prefix="seqkv-exact-step-") as tmp:
            results.append(measure(spec, args.tokens, args.threads, steps, Path(tmp)))
            print(results[-1], flush=True)
    return harness.finish(args, None, markdown, models=results)


if __name__ == "__main__":
    main()
