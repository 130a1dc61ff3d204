"""Restore and compress on a shared machine: OpenMP's wait policy, measured with neighbours.

Every case runs the `seqkv` command itself (a fresh process, as a user runs it) on one
N-token `seq` archive of sample_data/prose.txt: alone; two decompressions started together;
one next to a busy CPU process (a pure-Python loop, like a browser tab at full tilt); and
`compress` with its default verify, quiet and next to the busy process. Each case twice:
as before (the Typer app run directly, OMP_WAIT_POLICY unset: OpenMP's default spin-then-
sleep waits) and as the `seqkv` command runs now (it sets OMP_WAIT_POLICY=PASSIVE). Run it
alone on the machine.

    python -m bench.studies.contention --tokens 120 --append docs/BENCHMARKS_LOG.md
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import harness
from bench.harness import SAMPLE
from bench.table import table

SEQKV = str(Path(sys.executable).with_name("seqkv"))  # sets OMP_WAIT_POLICY=PASSIVE
BEFORE = [sys.executable, "-c", "from seqkv_cli.cli import app; app()"]  # leaves it unset
POLICIES = {"before": BEFORE, "now": [SEQKV]}
BUSY = [sys.executable, "-c", "while True: pass"]


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}


def _timed_together(commands: list[list[str]], env: dict, busy: bool) -> list[float]:
    """Start `commands` at once (next to a busy process if asked); each one's wall seconds."""
    neighbour = subprocess.Popen(BUSY) if busy else None
    try:
        if neighbour:
            time.sleep(1.0)  # the neighbour is running before the measured commands start
        start = time.perf_counter()
        procs = [
            subprocess.Popen(c, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            for c in commands
        ]
        out = []
        for p in procs:
            _, err = p.communicate()
            if p.returncode != 0:
                raise SystemExit(f"{' '.join(p.args)} failed: {err.decode()[-500:]}")
            out.append(time.perf_counter() - start)
        return out
    finally:
        if neighbour:
            neighbour.kill()
            neighbour.wait()


def main(argv: list[str] | None = None) -> dict:
    parser = harness.parser(__doc__)
    parser.add_argument("--tokens", type=int, default=120)
    parser.add_argument(
        "--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES),
        help="'now' alone halves the run (the before/after table was measured at 120 tokens)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    import seqkv_cli as seqkv

    lm = harness.start(args)
    model = harness.model_options(args)
    ids = lm.tokenizer((SAMPLE / "prose.txt").read_text())["input_ids"][: args.tokens]
    folder = Path(tempfile.mkdtemp(prefix="seqkv-contention-"))
    try:
        archive = folder / "s.skv"
        with seqkv.open_archive(archive, model=lm) as arc:
            arc.add("prose", ids)
        caps = seqkv.capture(
            [str(SAMPLE / "prose.txt")], model=lm, out=folder / "caps", max_tokens=args.tokens
        )
        cap = str(caps[0].path)

        rows = []
        env = _env()
        for policy in args.policies:
            seqkv_cmd = POLICIES[policy]

            def decompress(k: int, cmd=seqkv_cmd) -> list[str]:
                return [*cmd, "decompress", str(archive), "-o", str(folder / f"out-{k}"), *model]

            def compress(k: int, cmd=seqkv_cmd) -> list[str]:
                return [*cmd, "compress", cap, "-o", str(folder / f"c-{k}.skv"), "--codec", "seq",
                        *model]  # fmt: skip

            cases = {
                "decompress alone": ([decompress(0)], False),
                "two decompress together": ([decompress(1), decompress(2)], False),
                "decompress next to a busy process": ([decompress(3)], True),
                "compress + verify alone": ([compress(0)], False),
                "compress + verify next to a busy process": ([compress(1)], True),
            }
            for name, (commands, busy) in cases.items():
                seconds = _timed_together(commands, env, busy)
                for path in folder.glob("out-*"):
                    shutil.rmtree(path)
                for path in folder.glob("c-*.skv"):
                    path.unlink()
                rows.append(
                    {"policy": policy, "case": name, "seconds": [round(s, 1) for s in seconds]}
                )
                print(rows[-1], flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return harness.finish(args, lm, markdown, tokens=args.tokens, rows=rows)


def markdown(result: dict) -> str:
    by = {(r["policy"], r["case"]): max(r["seconds"]) for r in result["rows"]}
    policies = list(dict.fromkeys(r["policy"] for r in result["rows"]))
    titles = {"before": "before (OpenMP default waits)", "now": "now (`seqkv`: PASSIVE)"}
    lines = [
        *harness.heading("Threads under contention (`bench/studies/contention.py`)", result),
        f"A {result['tokens']}-token `seq` archive of prose.txt.",
        "",
    ]
    rows = []
    for case in dict.fromkeys(r["case"] for r in result["rows"]):
        base = "compress + verify alone" if case.startswith("compress") else "decompress alone"
        cells = [case]
        for policy in policies:
            s = by[(policy, case)]
            cells += [f"{s:.1f} s", f"{s / by[(policy, base)]:.2f}"]
        rows.append(cells)
    head = ["case", *(h for p in policies for h in (titles[p], "vs alone"))]
    lines += table(head, rows, align="l" + "rr" * len(policies))
    lines += ["", "Two at once: the slower of the two; vs alone is against the same policy.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
