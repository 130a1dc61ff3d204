"""Chunk-parallel `seq` streams (`compress --parallel N`): the bits they cost, the speed they buy.

Each case is captured with the embedded model (portable numerics, bf16). Bits: the session
(truncated to `--tokens`) has its token stream coded as N runs for every N of `--runs`, and
the token payload is compared with N = 1 (the same coder the codec uses, without writing
files). Speed: the session truncated to `--speed-tokens` is compressed with `seq` for every N
of `--speed-runs` and restored (guesses on, the default); every restore must equal the
capture bit for bit (tokens, surprisal, every K/V tensor) or the bench stops. A plain
transformers DynamicCache step loop over the same tokens is timed for scale.

    python -m bench.studies.parallel --json bench/results/parallel.json
    # no restores
    python -m bench.studies.parallel --bits-only --json bench/results/parallel-bits.json
"""

from __future__ import annotations

from pathlib import Path

import torch

from bench import harness
from bench.harness import SAMPLE
from bench.suite.common import restore_all
from bench.table import table

CASES = {
    "prose": "prose.txt",
    "code": "sample_code.py",
    "agent transcript": "agent_transcript.jsonl",
}


def token_bits(canon, tokens, runs: int) -> tuple[int, float]:
    """(token stream bytes, ideal bits) of one session coded as `runs` runs."""
    from seqkv_cli.sequential.adapter import CanonicalLogits
    from seqkv_cli.sequential.seq import SeqCodec

    data, ideal = SeqCodec(parallel=runs).encode_tokens(tokens, CanonicalLogits(canon))
    return len(data), ideal


def measure(lm, name: str, args, folder: Path) -> dict:
    from bench.studies.seq import hf_step_loop
    from seqkv_cli.archive import compress_captures, same_capture
    from seqkv_cli.kvcapture.api import capture
    from seqkv_cli.kvcapture.capture_file import load_capture

    [res] = capture(
        [str(SAMPLE / CASES[name])],
        model=lm,
        out=folder / "caps",
        max_tokens=args.tokens,
        truncate=True,
    )
    cap = load_capture(res.path)
    tokens = cap.tokens.numpy().astype("int64")
    row = {"case": name, "tokens": len(tokens), "log2_ppl": round(float(cap.surprisal.mean()), 4)}
    from seqkv_cli.archive import load_canonical
    from seqkv_cli.runtime.numerics import DEFAULT

    canon, _ = load_canonical(lm, DEFAULT)
    base = None
    row["bits"] = []
    for runs in sorted(set([1, *args.runs])):
        size, _ = token_bits(canon, tokens, runs)
        base = base or size
        row["bits"].append(
            {
                "runs": runs,
                "token_bytes": size,
                "bits_per_position": round(size * 8 / len(tokens), 4),
                "vs_one_run": round(size / base, 4),
            }
        )
        print(name, row["bits"][-1], flush=True)
    if args.bits_only:
        return row
    short = cap.positions if args.speed_tokens >= cap.positions else args.speed_tokens
    [res] = capture(
        [str(SAMPLE / CASES[name])],
        model=lm,
        out=folder / "short",
        max_tokens=short,
        truncate=True,
    )
    small = load_capture(res.path)
    row["speed_tokens"] = small.positions
    row["speed"] = []
    for runs in args.speed_runs:
        skv = folder / f"p{runs}.skv"
        spec = {"id": "seq", "numerics": DEFAULT, "parallel": runs}  # a dict names its path
        # check=False: the restore below is compared with the capture bit for bit
        compress_captures([res.path], skv, codec=spec, model=lm, check=False, layout="flat")
        restored, seconds, _ = restore_all(lm, skv)
        if not same_capture(small, restored[small.session_id]):
            raise SystemExit(f"{name}: --parallel {runs} restored differently")
        row["speed"].append(
            {
                "runs": runs,
                "file_bytes": skv.stat().st_size,
                "seconds": round(seconds, 1),
                "tokens_per_s": round(small.positions / seconds, 2),
                "bit_exact": True,
            }
        )
        print(name, row["speed"][-1], flush=True)
    one = row["speed"][0]["seconds"]
    for s in row["speed"]:
        s["speedup"] = round(one / s["seconds"], 3)
    row["hf_step_loop_tokens_per_s"] = round(hf_step_loop(lm, small.tokens), 2)
    return row


@torch.no_grad()  # nothing here trains: no autograd graphs
def main(argv: list[str] | None = None) -> dict:
    parser = harness.parser(__doc__)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--tokens", type=int, default=1024, help="tokens for the bits table")
    parser.add_argument("--runs", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--speed-tokens", type=int, default=512, help="tokens restored")
    parser.add_argument("--speed-runs", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--bits-only", action="store_true", help="the bits table alone")
    args = parser.parse_args(argv)
    if args.speed_runs[0] != 1:
        parser.error("--speed-runs must start with 1 (the speed-up is against it)")

    lm = harness.start(args)
    rows = harness.per_case(args.cases, lambda name, folder: measure(lm, name, args, folder))
    return harness.finish(args, lm, markdown, rows=rows)


def markdown(result: dict) -> str:
    lines = [
        *harness.heading("Chunk-parallel `seq` streams (`bench/studies/parallel.py`)", result),
    ]
    head = ["case", "tokens", "log2 PP", "runs", "token stream", "bits/position", "vs 1 run"]
    cells = [
        [r["case"], f"{r['tokens']:,}", f"{r['log2_ppl']:.3f}", b["runs"],
         f"{b['token_bytes']:,} B", f"{b['bits_per_position']:.3f}", f"{b['vs_one_run']:.3f}x"]
        for r in result["rows"]
        for b in r["bits"]
    ]  # fmt: skip
    lines += table(head, cells, align="lrrrrrr")
    if not all("speed" in r for r in result["rows"]):
        return "\n".join(lines) + "\n"
    head = [
        "case", "tokens restored", "runs", "file", "seconds", "tokens/s", "speed-up",
        "vs transformers step loop", "bit-exact",
    ]  # fmt: skip
    cells = [
        [r["case"], f"{r['speed_tokens']:,}", s["runs"], f"{s['file_bytes']:,} B", s["seconds"],
         f"{s['tokens_per_s']:.2f}", f"{s['speedup']:.2f}x",
         f"{s['tokens_per_s'] / loop:.2f}x ({loop:.1f} tok/s)", "yes" if s["bit_exact"] else "NO"]
        for r in result["rows"]
        for loop in [r["hf_step_loop_tokens_per_s"]]
        for s in r["speed"]
    ]  # fmt: skip
    lines += ["", *table(head, cells, align="lrrrrrrrl")]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
