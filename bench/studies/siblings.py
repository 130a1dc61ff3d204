"""Restoring sibling sessions together: tokens/s of 8 sessions at once vs one session alone.

Two archives, both `seq` tries on the embedded model (portable numerics, bf16 captures):

* **chats**: sample_data/chats.jsonl's first `--sessions` chats, which share their system
  prompt (~600 tokens) and differ after it, as the conversations of one support bot do;
* **independent**: `--sessions` slices of sample_data prose and code of `--tokens` tokens
  that share nothing, so all that helps is stepping them as rows of one pass.

For each: restore the first session alone, then all sessions at once (`Archive.restore_many`,
guesses on, the default), each restore compared with its capture bit for bit. Reported:
restored positions per second (what a user gets back: every session whole) and decoded
tokens per second (a shared prefix counts once), and model passes. Run alone on the machine.

    python -m bench.studies.siblings --json bench/results/siblings.json \\
        --append docs/BENCHMARKS_LOG.md
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench import harness
from bench.harness import SAMPLE, timed
from bench.table import table


def chat_inputs(folder: Path, count: int) -> list[Path]:
    lines = (SAMPLE / "chats.jsonl").read_text(encoding="utf-8").splitlines()
    chats = [json.loads(line) for line in lines if line.strip()]
    chats = [c for c in chats if c["id"].startswith("chat-")][:count]
    path = folder / "chats.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in chats), encoding="utf-8")
    return [path]


def independent_inputs(folder: Path, count: int) -> list[Path]:
    """`count` texts sharing no prefix: alternating prose and code slices."""
    sources = [(SAMPLE / n).read_text(encoding="utf-8") for n in ("prose.txt", "sample_code.py")]
    out = []
    for i in range(count):
        text = sources[i % 2]
        start = (i // 2) * (len(text) // max(1, count // 2 + 1))
        path = folder / f"text-{i:02d}.txt"
        path.write_text(text[start:], encoding="utf-8")
        out.append(path)
    return out


def passes_counter():
    """Rows of every canonical pass (one token a row, or a row's guessed tokens), counted by
    wrapping the adapter's two feeds."""
    from seqkv_cli.sequential.adapter import CanonicalLogits

    passes: list[int] = []
    rows, drafts = CanonicalLogits.feed_rows, CanonicalLogits.feed_drafts

    def feed_rows(self, tracks, ids):
        passes.append(len(tracks))
        return rows(self, tracks, ids)

    def feed_drafts(self, tracks, token_lists):
        passes.append(sum(len(t) for t in token_lists))
        return drafts(self, tracks, token_lists)

    def undo():
        CanonicalLogits.feed_rows, CanonicalLogits.feed_drafts = rows, drafts

    CanonicalLogits.feed_rows, CanonicalLogits.feed_drafts = feed_rows, feed_drafts
    return passes, undo


def restore(lm, skv: Path, entries_of, captures: dict) -> dict:
    from seqkv_cli.archive import Archive, same_capture

    passes, undo = passes_counter()
    try:
        with Archive(skv, model=lm) as arc:
            arc.canonical()  # model set-up is not restore time
            entries = entries_of(arc.sessions)
            pairs, seconds = timed(lambda: list(arc.restore_many(entries)))
            decoded = _decoded_tokens(arc, entries)
    finally:
        undo()
    for entry, got in pairs:
        if isinstance(got, Exception) or not same_capture(captures[entry["id"]], got):
            raise SystemExit(f"{skv.name}: session {entry['id']} restored differently: {got}")
    positions = sum(e["positions"] for e, _ in pairs)
    return {
        "sessions": len(pairs),
        "positions": positions,
        "decoded_tokens": decoded,
        "seconds": round(seconds, 2),
        "positions_per_s": round(positions / seconds, 2),
        "decoded_tokens_per_s": round(decoded / seconds, 2),
        "passes": len(passes),
        "rows": sum(passes),  # tokens fed, guesses included
    }


def _decoded_tokens(arc, entries) -> int:
    """Tokens the restore decodes: every trie node on the sessions' paths, once."""
    if arc.trie is None:
        return sum(e["positions"] for e in entries)
    from seqkv_cli.trie import chain

    nodes = set()
    for e in entries:
        nodes.update(chain(arc.trie.nodes, e["trie"]["node"]))
    return sum(arc.trie.nodes[n].n_tokens for n in nodes)


def measure(lm, name: str, inputs, args, folder: Path) -> dict:
    from seqkv_cli.archive import compress_captures
    from seqkv_cli.kvcapture.api import capture
    from seqkv_cli.kvcapture.capture_file import load_capture
    from seqkv_cli.runtime.numerics import DEFAULT

    paths = inputs(folder, args.sessions)
    results = capture(
        [str(p) for p in paths], model=lm, out=folder / "caps", max_tokens=args.tokens,
        truncate=True,
    )  # fmt: skip
    captures = {load_capture(r.path).session_id: load_capture(r.path) for r in results}
    skv = folder / f"{name}.skv"
    spec = {"id": "seq", "numerics": DEFAULT}
    compress_captures([r.path for r in results], skv, codec=spec, model=lm, check=False)
    alone = restore(lm, skv, lambda sessions: sessions[:1], captures)
    print(name, "alone", alone, flush=True)
    together = restore(lm, skv, lambda sessions: sessions, captures)
    print(name, "together", together, flush=True)
    return {
        "case": name,
        "file_bytes": skv.stat().st_size,
        "alone": alone,
        "together": together,
        "positions_ratio": round(together["positions_per_s"] / alone["positions_per_s"], 2),
        "decoded_ratio": round(together["decoded_tokens_per_s"] / alone["decoded_tokens_per_s"], 2),
    }


CASES = {"chats": chat_inputs, "independent": independent_inputs}


@torch.no_grad()  # nothing here trains: no autograd graphs
def main(argv: list[str] | None = None) -> dict:
    parser = harness.parser(__doc__)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=160, help="independent: tokens each")
    args = parser.parse_args(argv)
    lm = harness.start(args)

    def case(name: str, folder: Path) -> dict:
        case_args = argparse.Namespace(**vars(args))
        if name == "chats":
            case_args.tokens = None  # whole chats: the shared prompt and each reply
        return measure(lm, name, CASES[name], case_args, folder)

    rows = harness.per_case(args.cases, case)
    return harness.finish(args, lm, markdown, rows=rows)


def markdown(result: dict) -> str:
    lines = [
        *harness.heading(
            "Sibling sessions restored together (`bench/studies/siblings.py`, issue 12)", result
        ),
    ]
    cells = []
    for r in result["rows"]:
        for label in ("alone", "together"):
            m = r[label]
            ratio = (
                "1.00x, 1.00x"
                if label == "alone"
                else f"**{r['positions_ratio']:.2f}x**, {r['decoded_ratio']:.2f}x"
            )
            cells.append(
                [f"{r['case']} ({label})", m["sessions"], f"{m['positions']:,}",
                 f"{m['decoded_tokens']:,}", f"{m['passes']:,}", m["seconds"],
                 f"{m['positions_per_s']:.2f}", f"{m['decoded_tokens_per_s']:.2f}", ratio]
            )  # fmt: skip
    head = [
        "case", "sessions restored", "positions", "decoded tokens", "passes", "seconds",
        "positions/s", "decoded tokens/s", "vs one alone (positions/s, decoded/s)",
    ]  # fmt: skip
    lines += table(head, cells, align="lrrrrrrrl")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
