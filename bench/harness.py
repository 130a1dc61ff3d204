"""The one harness every bench runs on: its command line, its environment line, its clock,
and its one publish of results (JSON + Markdown, written atomically through seqkv's
`fsutil.atomic_path`).

Benches run as modules from the repository root (``python -m bench.studies.drafts --json
out.json``); each keeps its own measurements and adds only its own options to `parser`'s
common ones.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "sample_data"


# --- the command line ---------------------------------------------------------------------


def parser(doc: str, *, threads: int | None = None, model: bool = True) -> argparse.ArgumentParser:
    """A bench's parser with the options all benches share: --json, --append, --threads and
    (for benches that load a model) --model. `threads` is the bench's default thread count
    (None: torch's own choice, left as it is)."""
    out = argparse.ArgumentParser(description=doc.splitlines()[0])
    out.add_argument("--json", type=Path, help="write the raw numbers here")
    out.add_argument("--append", type=Path, help="append the Markdown report to this file")
    default = "torch's choice" if threads is None else threads
    out.add_argument(
        "--threads", type=int, default=threads, help=f"torch threads (default {default})"
    )
    if model:
        out.add_argument("--model", help="model folder or .gguf (default: the embedded model)")
    return out


def start(args: argparse.Namespace, *, load: bool = True):
    """Apply the common options: torch threads, then (`load`, where the bench has --model)
    the model: --model, else the embedded one. Returns the loaded model or None."""
    if args.threads:
        torch.set_num_threads(args.threads)
    if not load or not hasattr(args, "model"):
        return None
    from seqkv_cli.runtime.loading import load_model

    return load_model(args.model)


def model_options(args: argparse.Namespace) -> list[str]:
    """`--model M` for the `seqkv` processes a bench starts, where the bench was given one."""
    return ["--model", str(args.model)] if getattr(args, "model", None) else []


def command_line() -> str:
    """The exact command, as the user would type it from the repository root."""
    script = Path(sys.argv[0]).resolve()
    with contextlib.suppress(ValueError):
        relative = script.relative_to(ROOT)
        if relative.parts[0] == "bench" and relative.suffix == ".py":
            module = ".".join(relative.with_suffix("").parts)  # bench.studies.real_models
            return " ".join(["python", "-m", module, *sys.argv[1:]])
        script = relative
    return " ".join(["python", script.as_posix(), *sys.argv[1:]])


# --- the clock ----------------------------------------------------------------------------


def timed(fn: Callable[[], object]) -> tuple[object, float]:
    """(what `fn()` returned, its wall seconds)."""
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def best_of(fn: Callable[[], object], repeat: int) -> tuple[object, float]:
    """`timed` `repeat` times: (the last result, the fewest seconds)."""
    best, result = float("inf"), None
    for _ in range(repeat):
        result, seconds = timed(fn)
        best = min(best, seconds)
    return result, best


def per_case(cases, measure: Callable[[object, Path], dict]) -> list[dict]:
    """`measure(case, folder)` for every case, each in a scratch folder of its own that is
    gone before the next case starts; each row printed as it comes (a long run shows progress
    and a stopped one what it had)."""
    import tempfile

    rows = []
    for case in cases:
        with tempfile.TemporaryDirectory(prefix="seqkv-bench-") as tmp:
            rows.append(measure(case, Path(tmp)))
        print(rows[-1], flush=True)
    return rows


# --- the environment ----------------------------------------------------------------------


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


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except ImportError:
        return None


def environment(lm=None) -> dict:
    """Date, machine, load and versions: recorded next to every table. The load average at
    the start says whether the machine was shared (above ~1 on an otherwise idle machine)."""
    from seqkv_cli import __version__

    env = {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%MZ"),
        "machine": platform.machine(),
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "load_average_1min": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": _version("numpy"),
        "transformers": _version("transformers"),
        "zstandard": _version("zstandard"),
        "seqkv": __version__,
        "commit": _git_commit(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }
    if lm is not None:
        env["model"] = {"name": lm.name, "fingerprint": lm.fingerprint[:16]}
    return env


def environment_line(env: dict, command: str) -> str:
    """The line under a bench table's heading: when, where, which versions, which command."""
    load = env.get("load_average_1min")
    return (
        f"{env['date']}, {env['cpu']} ({env['cores']} cores"
        f"{'' if load is None else f', load {load:.1f} at start'}), torch threads "
        f"{env['torch_threads']}, torch {env['torch']}, transformers {env.get('transformers')}, "
        f"seqkv {env['seqkv']} ({env['commit']}). Command: `{command}`"
    )


# --- the one publish ----------------------------------------------------------------------


def write_text(path: Path, text: str) -> None:
    """`text` at `path` through seqkv's one publish: a reader never sees half a file."""
    from seqkv_cli.fsutil import atomic_path

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json(path: Path, payload: dict) -> None:
    write_text(path, json.dumps(payload, indent=2, default=float) + "\n")


def append_markdown(path: Path, text: str) -> None:
    """Append to a Markdown file atomically (the old content is rewritten with the new)."""
    path = Path(path)
    old = path.read_text(encoding="utf-8") if path.exists() else ""
    write_text(path, old.rstrip("\n") + "\n\n" + text.strip("\n") + "\n")


def publish(result: dict, table: str, json_path: Path | None, markdown_path: Path | None) -> None:
    """A bench's end: its Markdown table printed, the result written as JSON and the table
    appended to a Markdown file where the command line asked for them."""
    if json_path:
        write_json(json_path, result)
    print(table)
    if markdown_path:
        append_markdown(markdown_path, table)


def finish(args: argparse.Namespace, lm, markdown: Callable[[dict], str], **fields) -> dict:
    """The usual end of a bench: its fields with the environment and the command, rendered
    by `markdown` and published where --json/--append say. Returns the result."""
    result = {"environment": environment(lm), "command": command_line(), **fields}
    publish(result, markdown(result), args.json, args.append)
    return result


def heading(title: str, result: dict) -> list[str]:
    """A bench table's first lines: its title, then the environment line."""
    return [f"### {title}", "", environment_line(result["environment"], result["command"]), ""]
