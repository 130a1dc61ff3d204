"""A user's own model, end to end, as whole processes: peak memory and seconds of each step.

Each step is one `seqkv` command (or a short Python program for the library API and the
baselines), run as its own process under GNU time (`/usr/bin/time -v`, its "Maximum resident
set size"), in the order a user runs them:

    load            the model loaded, nothing run (a Python program)
    capture_plain   `seqkv capture --no-canonical`: the ordinary transformers run, the yardstick
    capture         `seqkv capture` (portable numerics)
    compress        `seqkv compress` (`seq`: a walk of the model, then a restore to check)
    decompress      `seqkv decompress`, then the restore compared with the capture bit for bit
    archive_add     `seqkv archive add` of a second, shorter session
    api_load        `open_archive(...).load(...)` of the first session (a Python program)
    hf_step_loop    transformers fp32, one forward a token over the same tokens (a Python
                    program): what a `seq` restore is compared with

    python -m bench.studies.real_models --model FOLDER_OR_GGUF --tokens 1000 --json out.json

`--steps` picks some; `--codec seq-fast` codes with `seq-fast` (one prefill to restore), which is
how long sessions are measured:

    python -m bench.studies.real_models --model FOLDER --tokens 16000 --codec seq-fast \
        --steps capture_plain,capture,compress,decompress
Models at real shapes come from `bench.real_shapes` (random weights, public configs).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import harness
from bench.harness import SAMPLE

STEPS = (
    "load",
    "capture_plain",
    "capture",
    "compress",
    "decompress",
    "archive_add",
    "api_load",
    "hf_step_loop",
)
TIME = "/usr/bin/time"


def text_of(tokens: int, folder: Path) -> Path:
    """A text of at least ``tokens`` tokens of any tokenizer: sample prose and code, repeated."""
    parts = [(SAMPLE / name).read_text() for name in ("prose.txt", "sample_code.py")]
    body = "\n\n".join(parts)
    text = body * max(1, tokens * 8 // len(body) + 1)
    path = folder / "text.txt"
    path.write_text(text)
    return path


def timed_process(args: list[str], folder: Path, env: dict | None = None) -> dict:
    """Run ``args`` under GNU time: its wall seconds and peak RSS (GiB); fail loudly."""
    report = folder / "time.txt"
    cmd = [TIME, "-v", "-o", str(report), *args]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args[:4])}... failed:\n{done.stderr[-3000:]}")
    stats = report.read_text()
    kib = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", stats).group(1))
    return {"seconds": round(seconds, 1), "peak_GiB": round(kib / 2**20, 3)}


PYTHON_LOAD = "from seqkv_cli.runtime.loading import load_model; load_model({model!r})"
PYTHON_API_LOAD = (
    "import seqkv_cli\n"
    "with seqkv_cli.open_archive({skv!r}, model={model!r}) as arc:\n"
    "    arc.load(arc.sessions()[0].id)\n"
)
PYTHON_STEP_LOOP = """
import torch
from transformers import DynamicCache
from seqkv_cli.kvcapture.capture_file import load_capture
from seqkv_cli.runtime.loading import load_model
ids = load_capture({capture!r}).tokens.long()
model = load_model({model!r}).fp32_model()
cache = DynamicCache()
with torch.inference_mode():
    for i in range(len(ids)):
        out = model(input_ids=ids[i : i + 1][None], past_key_values=cache, use_cache=True)
        cache = out.past_key_values
"""


def seqkv(*args: str) -> list[str]:
    return [sys.executable, "-m", "seqkv_cli", *args]


def run(model: str, tokens: int, steps: tuple[str, ...], folder: Path, codec: str = "seq") -> dict:
    text = text_of(tokens, folder)
    second = folder / "second.txt"
    second.write_text(text.read_text()[::-1][: len(text.read_text()) // 3])
    m = ["--model", model]
    cap, plain, skv = folder / "cap.safetensors", folder / "plain.safetensors", folder / "s.skv"
    limit = ["--max-tokens", str(tokens), "--truncate"]
    commands = {
        "load": [sys.executable, "-c", PYTHON_LOAD.format(model=model)],
        "capture_plain": seqkv(
            "capture", str(text), "-o", str(plain), *m, *limit, "--no-canonical"
        ),
        "capture": seqkv("capture", str(text), "-o", str(cap), *m, *limit),
        "compress": seqkv("compress", str(cap), "-o", str(skv), "--codec", codec, *m),
        "decompress": seqkv("decompress", str(skv), "-o", str(folder / "out"), *m),
        "archive_add": [],  # built below: it needs a second capture first
        "api_load": [sys.executable, "-c", PYTHON_API_LOAD.format(skv=str(skv), model=model)],
        "hf_step_loop": [
            sys.executable,
            "-c",
            PYTHON_STEP_LOOP.format(capture=str(cap), model=model),
        ],
    }
    rows: dict[str, dict] = {}
    for step in STEPS:
        if step not in steps:
            continue
        if step == "archive_add":
            extra = folder / "second.safetensors"
            small = ["--max-tokens", str(max(8, tokens // 4)), "--truncate"]
            subprocess.run(seqkv("capture", str(second), "-o", str(extra), *m, *small), check=True)
            commands[step] = seqkv("archive", "add", str(skv), str(extra), *m)
        rows[step] = timed_process(commands[step], folder)
        if step == "decompress":
            rows[step]["bit_exact"] = same_capture(cap, next((folder / "out").glob("*")))
        print(step, rows[step], flush=True)
    return rows


def same_capture(a: Path, b: Path) -> bool:
    """Tokens and every K/V tensor equal, bit for bit."""
    import torch

    from seqkv_cli.kvcapture.capture_file import load_capture

    x, y = load_capture(a), load_capture(b)
    same = torch.equal(x.tokens, y.tokens)
    for kx, ky in zip([*x.keys, *x.values], [*y.keys, *y.values], strict=True):
        same &= torch.equal(kx.view(torch.int16), ky.view(torch.int16))
    return bool(same)


def markdown(result: dict) -> str:
    """The bench's table: a row a step, peaks against `capture --no-canonical`."""
    lines = harness.heading(
        f"Your model: {Path(result['model']).name}, {result['tokens']:,} tokens, "
        f"{result.get('codec', 'seq')}",
        result,
    )
    lines += [
        "| step | seconds | peak RSS (GiB) | peak / capture --no-canonical | bit-exact |",
        "|---|---:|---:|---:|---|",
    ]
    for step, row in result["steps"].items():
        ratio = row.get("peak_vs_capture_plain")
        exact = {True: "yes", False: "**no**"}.get(row.get("bit_exact"), "")
        lines.append(
            f"| {step} | {row['seconds']:.1f} | {row['peak_GiB']:.2f} | "
            f"{'' if ratio is None else f'{ratio:.2f}'} | {exact} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = harness.parser(__doc__)
    p.add_argument("--tokens", type=int, default=1000)
    p.add_argument("--steps", default=",".join(STEPS), help="comma-separated steps to run")
    p.add_argument("--codec", choices=("seq", "seq-fast"), default="seq", help="compress codec")
    args = p.parse_args(argv)
    if not args.model:
        raise SystemExit("give --model (a folder or .gguf; bench.real_shapes writes them)")
    steps = tuple(s for s in args.steps.split(",") if s)
    unknown = set(steps) - set(STEPS)
    if unknown:
        raise SystemExit(f"unknown steps {sorted(unknown)}; choose from {', '.join(STEPS)}")
    harness.start(args, load=False)
    with tempfile.TemporaryDirectory(prefix="seqkv-real-") as tmp:
        rows = run(args.model, args.tokens, steps, Path(tmp), args.codec)
    base = rows.get("capture_plain", {}).get("peak_GiB")
    for row in rows.values():
        if base:
            row["peak_vs_capture_plain"] = round(row["peak_GiB"] / base, 3)
    return harness.finish(
        args, None, markdown, model=args.model, tokens=args.tokens, codec=args.codec, steps=rows
    )


if __name__ == "__main__":
    main()
