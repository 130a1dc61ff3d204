"""A new install's first portable capture: whole processes, an empty numba cache, and where the
time goes.

Three processes capture the same text with the same model, each under GNU time:

    plain   `seqkv capture --no-canonical`: the ordinary transformers run, the yardstick
    cold    `seqkv capture` with NUMBA_CACHE_DIR an empty folder: every kernel compiled
    warm    the same again: the kernels loaded from that folder

The cold process records numba's compile events (`numba.core.event`): which kernels were
compiled, for which argument types, and the seconds each took. Nested compiles (a helper a
kernel calls) are counted inside their caller, so the listed seconds add up to the time the
process spent compiling.

    python -m bench.studies.first_run --tokens 1000 --json out.json
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from bench import harness
from bench.studies.real_models import text_of, timed_process

# Runs `seqkv` in this process with a listener on numba's compile events; writes them as JSON.
PROFILED_SEQKV = """
import json, sys, time
from numba.core import event

class Compiles(event.Listener):
    def __init__(self):
        self.depth, self.started, self.rows = 0, [], []
    def on_start(self, ev):
        self.depth += 1
        self.started.append(time.perf_counter())
    def on_end(self, ev):
        seconds = time.perf_counter() - self.started.pop()
        self.depth -= 1
        if self.depth == 0:
            fn = ev.data["dispatcher"].py_func
            self.rows.append([fn.__qualname__, str(ev.data["args"]), seconds])

compiles = Compiles()
event.register("numba:compile", compiles)
from seqkv_cli.cli import main
sys.argv = ["seqkv", *{args!r}]
try:
    main()
finally:
    with open({out!r}, "w") as f:
        json.dump(compiles.rows, f)
"""


def run(model: str | None, tokens: int, folder: Path) -> dict:
    text = text_of(tokens, folder)
    common = [str(text), "--max-tokens", str(tokens), "--truncate"]
    common += ["--model", model] if model else []
    cache = folder / "numba-cache"
    cache.mkdir()
    events = folder / "compiles.json"
    program = PROFILED_SEQKV.format(
        args=["capture", *common, "-o", str(folder / "cold.safetensors")], out=str(events)
    )
    seqkv = [sys.executable, "-m", "seqkv_cli", "capture", *common]
    numba_cache = {"NUMBA_CACHE_DIR": str(cache)}
    plain = [*seqkv, "-o", str(folder / "plain.safetensors"), "--no-canonical"]
    warm = [*seqkv, "-o", str(folder / "warm.safetensors")]
    rows = {
        "plain": timed_process(plain, folder),
        "cold": timed_process([sys.executable, "-c", program], folder, numba_cache),
        "warm": timed_process(warm, folder, numba_cache),
    }
    for row in rows.values():
        row["vs_plain"] = round(row["seconds"] / rows["plain"]["seconds"], 2)
    compiled = json.loads(events.read_text())
    by_kernel: dict[str, dict] = {}
    for name, _args, seconds in compiled:
        entry = by_kernel.setdefault(name, {"compiles": 0, "seconds": 0.0})
        entry["compiles"] += 1
        entry["seconds"] = round(entry["seconds"] + seconds, 2)
    return {
        "steps": rows,
        "compile_seconds": round(sum(s for *_, s in compiled), 1),
        "compiles": len(compiled),
        "kernels": dict(sorted(by_kernel.items(), key=lambda kv: -kv[1]["seconds"])),
    }


def markdown(result: dict) -> str:
    lines = harness.heading(
        f"First run: {Path(result['model']).name if result['model'] else 'embedded model'}, "
        f"{result['tokens']:,} tokens",
        result,
    )
    lines += ["| process | seconds | peak RSS (GiB) | / plain |", "|---|---:|---:|---:|"]
    for step, row in result["steps"].items():
        lines.append(
            f"| {step} | {row['seconds']:.1f} | {row['peak_GiB']:.2f} | {row['vs_plain']:.2f} |"
        )
    lines += [
        "",
        f"The cold process compiled {result['compiles']} kernels (top-level) in "
        f"{result['compile_seconds']:.1f} s:",
        "",
        "| kernel | compiles | seconds |",
        "|---|---:|---:|",
    ]
    for name, entry in result["kernels"].items():
        lines.append(f"| `{name}` | {entry['compiles']} | {entry['seconds']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = harness.parser(__doc__)
    p.add_argument("--tokens", type=int, default=1000)
    args = p.parse_args(argv)
    harness.start(args, load=False)
    with tempfile.TemporaryDirectory(prefix="seqkv-first-run-") as tmp:
        result = run(args.model, args.tokens, Path(tmp))
    return harness.finish(args, None, markdown, model=args.model, tokens=args.tokens, **result)


if __name__ == "__main__":
    main()
