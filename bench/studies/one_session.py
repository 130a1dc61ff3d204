"""One session, one file: what the compact layout (format 1.2) costs against the full layout.

Each sample_data text is captured with the embedded model (portable numerics, bf16) and
compressed alone with `seq`, once as a compact file (the default for one session) and once
with `--layout trie` (the full layout, which keeps capture provenance). Reported per text:
positions, log2 PP, the token payload, both files, whole-file bits/position, and issue 14's
bound for a one-session file, 1.02 x log2 PP + 512 / positions. With `--verify` (default
for prose only: decoding steps the model once per token), the compact file is decoded and
compared with its capture bit for bit before it is counted.

    python -m bench.studies.one_session --json bench/results/one_session.json \\
        --append docs/BENCHMARKS_LOG.md
"""

from __future__ import annotations

from pathlib import Path

import torch

from bench import harness
from bench.harness import SAMPLE, timed
from bench.table import table

TEXTS = ["prose.txt", "sample_code.py", "agent_transcript.jsonl"]


def measure(lm, text: str, folder: Path, verify: bool) -> dict:
    from seqkv_cli.archive import compress_captures
    from seqkv_cli.container import open_container
    from seqkv_cli.kvcapture.api import capture
    from seqkv_cli.kvcapture.capture_file import load_capture

    [result] = capture([str(SAMPLE / text)], model=lm, out=folder / "caps")
    cap = load_capture(result.path)
    compact, seconds = timed(
        lambda: compress_captures(
            [result.path], folder / "c.skv", codec="seq", model=lm, check=verify
        )
    )
    full = compress_captures(
        [result.path], folder / "t.skv", codec="seq", model=lm, check=False, layout="trie"
    )
    if compact.layout != "compact":
        raise SystemExit(f"{text}: the one-session file was not written compact")
    with open_container(folder / "c.skv") as reader:
        payload = reader.sections[0].length
    n = cap.positions
    bits = compact.file_bytes * 8 / n
    bound = 1.02 * cap.log2_ppl + 512 / n
    return {
        "text": text,
        "positions": n,
        "log2_ppl": round(cap.log2_ppl, 4),
        "token_payload_bytes": payload,
        "compact_file_bytes": compact.file_bytes,
        "compact_fixed_bytes": compact.file_bytes - payload,
        "trie_file_bytes": full.file_bytes,
        "compact_bits_per_position": round(bits, 4),
        "trie_bits_per_position": round(full.file_bytes * 8 / n, 4),
        "bound_bits_per_position": round(bound, 4),
        "within_bound": bits <= bound,
        "verified_bit_exact": verify,
        "compress_seconds": round(seconds, 1),
    }


@torch.no_grad()  # nothing here trains: no autograd graphs
def main(argv: list[str] | None = None) -> dict:
    parser = harness.parser(__doc__)
    parser.add_argument("--texts", nargs="+", default=TEXTS)
    parser.add_argument("--verify", nargs="*", default=["prose.txt"], help="texts to decode")
    args = parser.parse_args(argv)

    lm = harness.start(args)
    rows = harness.per_case(
        args.texts, lambda text, folder: measure(lm, text, folder, text in args.verify)
    )
    return harness.finish(args, lm, markdown, rows=rows)


def markdown(result: dict) -> str:
    lines = [
        *harness.heading(
            "One session, one file: the compact layout (`bench/studies/one_session.py`)", result
        ),
    ]
    head = [
        "text", "positions", "log2 PP", "token payload", "compact file", "fixed cost",
        "full trie file", "compact bits/pos", "full bits/pos", "bound 1.02·log2 PP + 512/n",
        "within", "bit-exact",
    ]  # fmt: skip
    cells = [
        [r["text"], f"{r['positions']:,}", f"{r['log2_ppl']:.3f}",
         f"{r['token_payload_bytes']:,} B", f"{r['compact_file_bytes']:,} B",
         f"{r['compact_fixed_bytes']} B", f"{r['trie_file_bytes']:,} B",
         f"{r['compact_bits_per_position']:.3f}", f"{r['trie_bits_per_position']:.3f}",
         f"{r['bound_bits_per_position']:.3f}", "yes" if r["within_bound"] else "NO",
         "verified" if r["verified_bit_exact"] else "not decoded"]
        for r in result["rows"]
    ]  # fmt: skip
    lines += table(head, cells, align="lrrrrrrrrrll")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
