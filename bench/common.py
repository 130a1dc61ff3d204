"""Shared pieces of the benchmark suite: progress lines, timing, environment, atomic writes.

The suite's modules import each other as ``bench.<name>``; ``bench/run.py`` and
``bench/gpu_check.py`` put the repository root on ``sys.path`` so they run as scripts.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "sample_data"
KV_BITS_16 = 16  # fp16/bf16 bits per K/V component: the "ratio vs fp16" baseline


@dataclass
class Run:
    """What every bench section gets: the model, a scratch folder, the size mode, a clock."""

    lm: object
    folder: Path
    quick: bool
    started: float = field(default_factory=time.perf_counter)

    def log(self, message: str) -> None:
        """One progress line with the time since the run started (the full run is ~30 min)."""
        print(f"[{time.perf_counter() - self.started:7.1f} s] {message}", flush=True)

    def scratch(self, name: str) -> Path:
        path = self.folder / name
        path.mkdir(parents=True, exist_ok=True)
        return path


def timed(fn: Callable[[], object]) -> tuple[object, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def compress(run: Run, paths: list[Path], out: Path, codec: str | dict):
    """`compress_captures` with check off (decode is timed on its own): (result, seconds)."""
    from seqkv_cli.skv.compress import compress_captures

    return timed(lambda: compress_captures(paths, out, codec=codec, model=run.lm, check=False))


def restore(run: Run, skv: Path, session_ids: list[str]) -> tuple[list, float]:
    """The sessions of an archive restored by the library, in the order of `session_ids`
    (a trie archive yields sessions as they finish, not in file order), and the seconds."""
    from seqkv_cli.skv.restore import Archive

    with Archive(skv, model=run.lm) as arc:
        if arc.needs_model:
            arc.canonical()  # built once per model; not part of the decode time
        pairs, seconds = timed(lambda: list(arc.restore_many(arc.sessions)))
    failed = [r for _, r in pairs if isinstance(r, Exception)]
    if failed:
        raise SystemExit(f"{Path(skv).name}: restore failed: {failed[0]}")
    by_id = {entry["id"]: r for entry, r in pairs}
    if sorted(by_id) != sorted(session_ids):
        raise SystemExit(f"{Path(skv).name}: restored {sorted(by_id)}, not {session_ids}")
    return [by_id[s] for s in session_ids], seconds


def fp16_bits_per_position(lm) -> int:
    """Bits one position of K/V takes at 16 bits per component (layers x 2 x heads x dim)."""
    return lm.num_layers * 2 * lm.num_kv_heads * lm.head_dim * KV_BITS_16


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_commit() -> str:
    """HEAD and whether the tree has local changes (read-only git calls)."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        return "unknown"
    return f"{head}{' (+ local changes)' if dirty else ''}" if head else "unknown"


def environment(lm=None) -> dict:
    """Date, machine and versions: recorded next to every table."""
    import datetime as dt

    import numpy as np
    import transformers
    import zstandard

    from seqkv_cli import __version__

    env = {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%MZ"),
        "machine": platform.machine(),
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "transformers": transformers.__version__,
        "zstandard": zstandard.__version__,
        "seqkv": __version__,
        "commit": _git_commit(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }
    if lm is not None:
        env["model"] = {"name": lm.name, "fingerprint": lm.fingerprint[:16]}
    return env


def command_line() -> str:
    """The exact command, as the user would type it from the repository root."""
    script = Path(sys.argv[0]).resolve()
    with contextlib.suppress(ValueError):
        script = script.relative_to(ROOT)
    return " ".join(["python", script.as_posix(), *sys.argv[1:]])


def write_atomic(path: Path, text: str) -> None:
    """Temp file in the same folder + os.replace: a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: Path, payload: dict) -> None:
    write_atomic(path, json.dumps(payload, indent=2, default=float) + "\n")


def append_markdown(path: Path, text: str) -> None:
    """Append to a Markdown file atomically (the old content is rewritten with the new)."""
    path = Path(path)
    old = path.read_text(encoding="utf-8") if path.exists() else ""
    write_atomic(path, old.rstrip("\n") + "\n\n" + text.strip("\n") + "\n")


def publish(result: dict, table: str, json_path: Path | None, markdown_path: Path | None) -> None:
    """A bench's end: its Markdown table printed, the result written as JSON and the table
    appended to a Markdown file where the command line asked for them."""
    if json_path:
        write_json(json_path, result)
    print(table)
    if markdown_path:
        append_markdown(markdown_path, table)


def environment_line(env: dict, command: str) -> str:
    """The line under a bench table's heading: when, where, which versions, which command."""
    return (
        f"{env['date']}, {env['cpu']} ({env['cores']} cores), torch threads "
        f"{env['torch_threads']}, torch {env['torch']}, seqkv {env['seqkv']} ({env['commit']}). "
        f"Command: `{command}`"
    )
