"""The benchmark suite: every codec on the embedded model, in one run on one machine.

    python -m bench.suite.run --append docs/BENCHMARKS_LOG.md          # full: <= 30 min on 2 cores
    python -m bench.suite.run --quick                               # smoke test: < 2 min

Sections (all by default; `--sections` picks some): rates (bits/position, ratio vs fp16,
log2 PP, fidelity, encode/decode speed of every codec), speed (ratios to plain transformers,
entropy coder vs zstd), memory (peak RSS of compress/decompress), context (scaling with
context length), sessions (scaling with sessions per archive), profile (where `seq` compress
spends its time). Raw numbers go to JSON (rewritten after every section, so a stopped run
keeps what it measured); the Markdown report is printed and, with --append, appended.
"""

from __future__ import annotations

import argparse
import datetime as dt
import tempfile
import time
from pathlib import Path

from bench import harness
from bench.harness import ROOT, append_markdown, command_line, environment, write_json
from bench.suite.common import Run

SECTIONS = ("rates", "speed", "memory", "context", "sessions", "profile")
PROFILE_TOKENS = 1024
MEMORY_CODECS = ("seq", "seq-fast", "lossless", "turbo3")
MEMORY_CODECS_QUICK = ("seq",)


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def _sections(text: str) -> tuple[str, ...]:
    chosen = tuple(s.strip() for s in text.split(",") if s.strip())
    unknown = [s for s in chosen if s not in SECTIONS]
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(f"unknown section(s) {unknown}; choose from {SECTIONS}")
    return chosen


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = harness.parser(__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    # --out is the suite's older name for --json, kept for the recorded commands
    parser.add_argument("--out", type=Path, help="raw JSON (default bench/results/run-DATE.json)")
    parser.add_argument("--sections", type=_sections, default=SECTIONS, help=",".join(SECTIONS))
    parser.add_argument(
        "--sessions", type=_ints, help="sessions per archive (default 1,2,5,10,20,50,100)"
    )
    parser.add_argument(
        "--sessions-decode", type=_ints, help="archive sizes whose decode is timed (10)"
    )
    parser.add_argument(
        "--sessions-singles", type=int, help="sessions also compressed alone (default 10)"
    )
    args = parser.parse_args(argv)
    args.out = args.out or args.json
    if args.out is None:
        stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M")
        args.out = ROOT / "bench" / "results" / f"run-{stamp}{'-quick' if args.quick else ''}.json"
    return args


def _one_session(run: Run, set_results: list) -> tuple[Path, int]:
    """The profile/memory input: 1,024 tokens of sample_code (quick: one short set capture)."""
    from bench.suite.inputs import save, slice_capture

    cap = max((r.capture for r in set_results), key=lambda c: c.positions)
    n = min(cap.positions, PROFILE_TOKENS)
    return save(slice_capture(cap, n, f"{cap.session_id}-{n}"), run.scratch("one")), n


def run_sections(run: Run, args: argparse.Namespace, payload: dict) -> None:
    from bench.suite.inputs import capture_set

    needs_set = {"rates", "speed", "memory", "profile"} & set(args.sections)
    set_results = []
    if needs_set:
        run.log("capturing the fixed set (canonical, bf16)")
        set_results = capture_set(run)
        payload["inputs"] = [
            {"session": r.capture.session_id, "positions": r.capture.positions} for r in set_results
        ]
    for name in args.sections:
        start = time.perf_counter()
        payload["results"][name] = _run_one(run, args, name, set_results)
        payload["section_seconds"][name] = time.perf_counter() - start
        write_json(args.out, payload)
        run.log(f"{name}: done in {payload['section_seconds'][name]:.0f} s")


def _run_one(run: Run, args: argparse.Namespace, name: str, set_results: list) -> dict:
    if name == "rates":
        from bench.suite.rates import run_rates

        return run_rates(run, set_results)
    if name == "speed":
        from bench.suite.speed import run_speed

        return run_speed(run, set_results)
    if name == "memory":
        from bench.suite.memory import run_memory

        path, n = _one_session(run, set_results)
        return run_memory(run, path, n, MEMORY_CODECS_QUICK if run.quick else MEMORY_CODECS)
    if name == "context":
        from bench.suite.context import run_context

        return run_context(run)
    if name == "sessions":
        from bench.suite.archives import run_archives

        return run_archives(run, args.sessions, args.sessions_decode, args.sessions_singles)
    from bench.suite.profile_seq import run_profile

    path, n = _one_session(run, set_results)
    return run_profile(run, path, n, with_check=not run.quick)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from bench.suite.report import render

    started = time.perf_counter()
    lm = harness.start(args)
    payload = {
        "command": command_line(),
        "quick": args.quick,
        "environment": environment(lm),
        "results": {},
        "section_seconds": {},
    }
    with tempfile.TemporaryDirectory(prefix="seqkv-bench-") as tmp:
        run = Run(lm, Path(tmp), args.quick, started)
        run.log(f"seqkv bench ({'quick' if args.quick else 'full'}); JSON: {args.out}")
        run_sections(run, args, payload)
    payload["total_seconds"] = time.perf_counter() - started
    write_json(args.out, payload)
    report = render(payload)
    print(report)
    if args.append:
        append_markdown(args.append, report)
        run.log(f"report appended to {args.append}")


if __name__ == "__main__":
    main()
