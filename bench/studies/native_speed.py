"""The portable forward against a transformers fp32 one, in one run: issue 29's ratios.

    python -m bench.studies.native_speed --json bench/results/native_speed.json \\
        --append docs/BENCHMARKS_LOG.md

* whole processes (the `seqkv` command, OMP_WAIT_POLICY=PASSIVE as it sets): `capture` of a
  ~2,000-token text (prose + code) on the default path (portable-fx53-v3) and on v2 (the
  previous default) against `capture --no-canonical`, and a `seq-fast` restore of it
  (`decompress`: tokens plus one portable prefill);
* in one process, interleaved so that both see the same machine: a one-token portable step
  against a transformers DynamicCache step on the same tokens, a 256-token prefill each, and
  `seq` decode of one session (and of 8 sessions as rows) against the transformers step loop;
  for v3 and for v2 (``--reference`` adds v3 with the native kernels off,
  ``SEQKV_PORTABLE_KERNELS=reference``).
Run it alone: on 2 cores a neighbour's load is measured too.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench import harness
from bench.harness import SAMPLE
from bench.table import table

TOKENS = 2000


def _seqkv(*args: str, env: dict | None = None) -> float:
    """Seconds of one `seqkv` process (exit 0 required)."""
    cmd = [sys.executable, "-m", "seqkv_cli", *args]
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    seconds = time.perf_counter() - t
    if proc.returncode:
        raise SystemExit(f"{' '.join(args)} failed: {proc.stderr.strip().splitlines()[-1:]}")
    return seconds


def processes(folder: Path, lm, threads: int, model: list[str]) -> dict:
    text = (SAMPLE / "prose.txt").read_text() + "\n" + (SAMPLE / "sample_code.py").read_text()
    ids = lm.tokenizer(text).input_ids[:TOKENS]
    src = folder / "prose_code.txt"
    src.write_text(lm.tokenizer.decode(ids))
    threads = ("--threads", str(threads), *model)
    plain = _seqkv(
        "capture", str(src), "-o", str(folder / "plain.safetensors"), "--no-canonical", *threads
    )
    canonical = _seqkv("capture", str(src), "-o", str(folder / "canon.safetensors"), *threads)
    v2 = _seqkv(
        "capture", str(src), "-o", str(folder / "v2.safetensors"), "--numerics", "portable-v2",
        *threads,
    )  # fmt: skip
    skv = folder / "fast.skv"
    _seqkv("compress", str(folder / "canon.safetensors"), "-o", str(skv), "--codec", "seq-fast",
           *threads)  # fmt: skip
    restore = _seqkv("decompress", str(skv), "-o", str(folder / "restored"), *threads)
    return {
        "capture_no_canonical_s": plain,
        "capture_portable_s": canonical,
        "capture_portable_v2_s": v2,
        "seq_fast_restore_s": restore,
        "capture_ratio": canonical / plain,
        "capture_v2_ratio": v2 / plain,
        "seq_fast_restore_ratio": restore / plain,
    }


def in_process(lm, path: str, reference: bool = False) -> dict:
    from transformers import DynamicCache

    from bench.studies.seq import decode_speed
    from seqkv_cli.kvcapture.engine import canonical_model
    from seqkv_cli.runtime.hfcompat import forward_with_cache
    from seqkv_cli.runtime.portable import kernels

    text = (SAMPLE / "prose.txt").read_text() + "\n" + (SAMPLE / "sample_code.py").read_text()
    ids = torch.tensor(lm.tokenizer(text).input_ids[:1200])
    saved = os.environ.get(kernels.ENV)
    if reference:
        os.environ[kernels.ENV] = "reference"
    try:
        lm.extra.pop(f"canonical:{path}", None)
        canon = canonical_model(lm, path)
        state = canon.new_state(400)
        with torch.inference_mode():
            t = time.perf_counter()
            canon.forward(state, ids[:256])
            portable_prefill = time.perf_counter() - t
            t = time.perf_counter()
            _, cache = forward_with_cache(lm.model, ids[None, :256], DynamicCache())
            hf_prefill = time.perf_counter() - t
            ours, theirs = [], []
            for i in range(256, 296):  # interleaved: both see the same machine
                t = time.perf_counter()
                canon.forward(state, ids[i : i + 1])
                ours.append(time.perf_counter() - t)
                t = time.perf_counter()
                _, cache = forward_with_cache(lm.model, ids[None, i : i + 1], cache)
                theirs.append(time.perf_counter() - t)
        step, hf_step = statistics.median(ours), statistics.median(theirs)
        steps = 24 if reference else 96
        one = decode_speed(lm, ids, 1, steps, path)
        rows = decode_speed(lm, ids, 8, steps, path)
        hf_loop = 1.0 / hf_step  # tokens/s of the transformers step loop
    finally:
        lm.extra.pop(f"canonical:{path}", None)
        if saved is None:
            os.environ.pop(kernels.ENV, None)
        else:
            os.environ[kernels.ENV] = saved
    return {
        "prefill_256_s": portable_prefill,
        "hf_prefill_256_s": hf_prefill,
        "prefill_ratio": portable_prefill / hf_prefill,
        "step_ms": 1000 * step,
        "hf_step_ms": 1000 * hf_step,
        "step_ratio": step / hf_step,
        "seq_decode_tokens_per_s_1_session": one,
        "seq_decode_tokens_per_s_8_sessions": rows,
        "seq_decode_vs_hf_step_loop": one / hf_loop,
        "siblings_8_vs_1": rows / one,
    }


def ratios(result: dict) -> str:
    p, runs = result["processes"], result["runs"]
    names = list(runs)
    measured = [
        ("prefill of 256 tokens, s", "prefill_256_s", "{:.2f}"),
        ("prefill / transformers prefill (same run)", "prefill_ratio", "{:.2f} x"),
        ("one-token step, ms", "step_ms", "{:.1f}"),
        ("step / transformers DynamicCache step (interleaved)", "step_ratio", "{:.2f} x"),
        ("`seq` decode, one session / transformers step loop", "seq_decode_vs_hf_step_loop",
         "{:.2f} x"),
        ("8 sessions as rows / one session", "siblings_8_vs_1", "{:.2f} x"),
    ]  # fmt: skip
    cells = [[label, *(fmt.format(runs[n][key]) for n in names)] for label, key, fmt in measured]
    lines = table(["measurement", *names], cells)
    first = runs[names[0]]
    lines.append(
        f"\nWhole processes ({TOKENS} tokens of prose + code): `seqkv capture` "
        f"{p['capture_portable_s']:.1f} s against `--no-canonical` "
        f"{p['capture_no_canonical_s']:.1f} s (**{p['capture_ratio']:.2f} x**; "
        f"`--numerics portable-v2` {p['capture_portable_v2_s']:.1f} s, "
        f"{p['capture_v2_ratio']:.2f} x); `seq-fast` restore (`decompress`) "
        f"{p['seq_fast_restore_s']:.1f} s (**{p['seq_fast_restore_ratio']:.2f} x**). "
        f"transformers step {first['hf_step_ms']:.1f} ms, prefill "
        f"{first['hf_prefill_256_s']:.2f} s."
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = harness.parser(__doc__, threads=2)
    parser.add_argument("--reference", action="store_true", help="add v3 without the kernels")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # what the seqkv command sets
    from seqkv_cli.runtime.numerics import PORTABLE, PORTABLE_V2

    lm = harness.start(args)
    with tempfile.TemporaryDirectory() as tmp:
        procs = processes(Path(tmp), lm, args.threads, harness.model_options(args))
    print("processes", procs, flush=True)
    runs = {PORTABLE: in_process(lm, PORTABLE), PORTABLE_V2: in_process(lm, PORTABLE_V2)}
    if args.reference:
        runs[f"{PORTABLE}, torch reference"] = in_process(lm, PORTABLE, reference=True)
    print("runs", runs, flush=True)
    return harness.finish(args, lm, markdown, processes=procs, runs=runs)


def markdown(result: dict) -> str:
    title = "The portable forward at native speed (issue 29)"
    return "\n".join([*harness.heading(title, result), ratios(result)]) + "\n"


if __name__ == "__main__":
    main()
