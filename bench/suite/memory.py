"""Peak memory of compress and decompress, each in its own child process.

Each child reports its own peak resident memory (VmHWM; bench/suite/_child.py says why not
RUSAGE_CHILDREN: on Linux a child inherits the forking parent's high-water mark). Two
baselines separate the codec from what every process pays: Python + torch + seqkv imported,
and the same with the model loaded (session codecs).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from bench.suite.common import Run

CHILD = Path(__file__).resolve().parent / "_child.py"
SESSION_CODECS = ("seq", "seq-fast")


def peak(args: list[str]) -> dict:
    """Run `_child.py args`; return its peak RSS (MiB) and the op's seconds."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}  # as the parent
        cmd = [sys.executable, str(CHILD), *args]
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env)
        proc.wait()
        out.seek(0)
        err.seek(0)
        if proc.returncode != 0:
            raise SystemExit(f"memory child {args[:2]} failed: {err.read()[-2000:]}")
        lines = out.read().strip().splitlines()
    result = json.loads(lines[-1])
    return {"peak_rss_MiB": result["peak_rss_kib"] / 1024, "seconds": result["seconds"]}


def run_memory(run: Run, capture_path: Path, positions: int, codecs: tuple[str, ...]) -> dict:
    """Peak RSS of compress/decompress of one capture for each codec, plus the baselines."""
    spec = "-" if run.lm.kind == "embedded" else str(run.lm.folder)
    run.log("memory: baselines (imports; imports + model)")
    rows = [
        {"codec": "-", "op": "import only", **peak(["import"])},
        {"codec": "-", "op": "imports + model loaded", **peak(["model", spec])},
    ]
    folder = run.scratch("memory")
    for codec in codecs:
        needs = spec if codec in SESSION_CODECS else "none"
        skv = folder / f"{codec}.skv"
        run.log(f"memory: {codec} compress and decompress of {positions:,} positions")
        rows.append(
            {
                "codec": codec,
                "op": "compress",
                **peak(["compress", needs, codec, str(skv), str(capture_path)]),
            }
        )
        out = folder / f"{codec}-out"
        rows.append(
            {"codec": codec, "op": "decompress", **peak(["decompress", needs, str(skv), str(out)])}
        )
    return {"positions": positions, "capture": Path(capture_path).name, "rows": rows}
