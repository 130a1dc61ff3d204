"""Draft-and-verify decoding: tokens per model pass and restore speed, guesses on vs off.

Each case is captured with the embedded model (portable numerics, bf16), truncated to
`--tokens`, compressed with `seq`, and restored twice in this process: with guessed tokens
(the default) and with SEQKV_DRAFTS=off (one token per pass, the decoder before guesses).
Both restores must equal the capture bit for bit (tokens, surprisal, every K/V tensor), or
the bench stops. Reported per case: passes, tokens per pass (tau), guesses fed and right,
seconds and tokens/s each way, the speed-up, and a plain transformers DynamicCache step loop
over the same tokens for scale. The `pair` case restores two near-duplicate chats of one
archive together, so each can guess from the other.

    python -m bench.studies.drafts --json bench/results/drafts.json --append docs/BENCHMARKS_LOG.md
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from bench import harness
from bench.harness import SAMPLE
from bench.suite.common import restore_all
from bench.table import table

CASES = {
    "prose": ["prose.txt"],
    "code": ["sample_code.py"],
    "agent transcript": ["agent_transcript.jsonl"],
    "pair": ["chats.jsonl:chat-01", "chats.jsonl:near-01"],
}


def _inputs(spec: list[str], folder: Path) -> list[str]:
    """Files to capture: a whole sample file, or chosen sessions of a JSONL file."""
    import json

    out = []
    for item in spec:
        name, _, session = item.partition(":")
        if not session:
            out.append(str(SAMPLE / name))
            continue
        for line in (SAMPLE / name).read_text().splitlines():
            row = json.loads(line)
            if row.get("id") == session:
                path = folder / f"{session}.jsonl"
                path.write_text(json.dumps(row) + "\n")
                out.append(str(path))
    return out


def _restore(lm, path: Path, drafts: bool):
    os.environ["SEQKV_DRAFTS"] = "on" if drafts else "off"
    try:
        return restore_all(lm, path)
    finally:
        os.environ.pop("SEQKV_DRAFTS", None)


def measure(lm, name: str, spec: list[str], tokens: int, folder: Path) -> dict:
    from bench.studies.seq import hf_step_loop
    from seqkv_cli.archive import compress_captures, same_capture
    from seqkv_cli.kvcapture.api import capture
    from seqkv_cli.kvcapture.capture_file import load_capture

    results = capture(
        _inputs(spec, folder), model=lm, out=folder / "caps", max_tokens=tokens, truncate=True
    )
    caps = {c.session_id: c for c in (load_capture(r.path) for r in results)}
    # check=False: both restores below are compared with the capture bit for bit
    compress_captures(
        [r.path for r in results], folder / "a.skv", codec="seq", model=lm, check=False
    )
    row = {"case": name, "sessions": len(caps), "tokens": sum(c.positions for c in caps.values())}
    for mode, drafts in (("off", False), ("on", True)):
        restored, seconds, stats = _restore(lm, folder / "a.skv", drafts)
        for sid, cap in caps.items():
            if not same_capture(cap, restored[sid]):
                raise SystemExit(f"{name}: session {sid} restored differently with drafts {mode}")
        row[f"passes_{mode}"] = stats.passes
        row[f"seconds_{mode}"] = round(seconds, 1)
        row[f"tokens_per_s_{mode}"] = round(stats.tokens / seconds, 2)
        if drafts:
            row["tokens_per_step"] = round(stats.tokens_per_step, 3)
            row["drafted"], row["accepted"] = stats.drafted, stats.accepted
    row["speedup"] = round(row["seconds_off"] / row["seconds_on"], 3)
    ids = next(iter(caps.values())).tokens
    row["hf_step_loop_tokens_per_s"] = round(hf_step_loop(lm, ids), 2)
    row["on_vs_hf_step_loop"] = round(row["tokens_per_s_on"] / row["hf_step_loop_tokens_per_s"], 3)
    row["bit_exact"] = True
    return row


@torch.no_grad()  # nothing here trains: no autograd graphs
def main(argv: list[str] | None = None) -> dict:
    parser = harness.parser(__doc__)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--tokens", type=int, default=256, help="tokens per session")
    args = parser.parse_args(argv)

    lm = harness.start(args)
    rows = harness.per_case(
        args.cases, lambda name, folder: measure(lm, name, CASES[name], args.tokens, folder)
    )
    return harness.finish(args, lm, markdown, rows=rows)


def markdown(result: dict) -> str:
    head = [
        "case", "sessions", "tokens", "passes off → on", "tokens/step (τ)", "guesses right",
        "seconds off → on", "speed-up", "tokens/s on", "transformers step loop", "bit-exact",
    ]  # fmt: skip
    cells = [
        [r["case"], r["sessions"], f"{r['tokens']:,}",
         f"{r['passes_off']:,} → {r['passes_on']:,}", f"{r['tokens_per_step']:.2f}",
         f"{r['accepted']:,} / {r['drafted']:,}", f"{r['seconds_off']} → {r['seconds_on']}",
         f"{r['speedup']:.2f}x", f"{r['tokens_per_s_on']:.2f}",
         f"{r['hf_step_loop_tokens_per_s']:.1f} tok/s ({r['on_vs_hf_step_loop']:.2f}x)",
         "yes" if r["bit_exact"] else "NO"]
        for r in result["rows"]
    ]  # fmt: skip
    lines = [
        *harness.heading("Draft-and-verify decoding (`bench/studies/drafts.py`)", result),
        *table(head, cells, align="lrrrrrrrrrl"),
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
