"""Continuous batching in trie restore: model passes, rows and seconds to restore a whole tree.

Builds a trie archive whose nodes have uneven lengths and children (the sessions of
`--sessions` branches of random length off one shared prompt, each with two continuations),
restores every session, and counts the canonical forward's passes and rows. With `--compare
REV` the same archive is also restored by seqkv at git revision REV (a temporary worktree,
run in a subprocess), so before and after are measured in one run on one machine; both
restores must give the same bytes (a SHA-256 over every restored tensor).

    python -m bench.studies.trie_batching --compare HEAD~1 --json bench/results/trie_batching.json

The tiny random model (tests/conftest.py) is the default: pass counts do not depend on the
model, seconds do (`--model` takes a folder or .gguf; the embedded model's passes cost
0.26-0.57 s each on 2 cores, for 1-16 rows).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import harness

ROOT = harness.ROOT


def build(folder: Path, sessions: int, model: str | None) -> tuple[Path, str]:
    from seqkv_cli.archive import compress_captures
    from seqkv_cli.kvcapture.api import capture
    from seqkv_cli.runtime.loading import load_model
    from tests.conftest import build_tiny_model

    model = model or str(build_tiny_model(folder / "tiny", seed=3))
    lm = load_model(model)
    rng = random.Random(0)
    prompt = "System: answer briefly and cite the manual. " * 3
    texts = folder / "texts"
    texts.mkdir()
    for i in range(sessions):
        branch = "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(20, 200)))
        for k in range(2):
            tail = "".join(rng.choice("ijklmnop ") for _ in range(rng.randint(10, 120)))
            (texts / f"s{i:02d}-{k}.txt").write_text(f"{prompt}User {i}: {branch} / {k}{tail}")
    caps = capture(sorted(str(p) for p in texts.glob("*.txt")), model=lm, out=folder / "caps")
    path = folder / "tree.skv"
    compress_captures([c.path for c in caps], path, codec="seq", model=lm, check=False)
    return path, model


MEASURE = """
import hashlib, json, sys, time
import torch
from seqkv_cli.runtime.loading import load_model
from seqkv_cli.sequential.adapter import CanonicalLogits
from seqkv_cli.archive import Archive

lm = load_model(sys.argv[2])
passes, rows = [0], [0]
real = CanonicalLogits.feed_rows
def counting(self, tracks, ids):
    passes[0] += 1
    rows[0] += len(tracks)
    return real(self, tracks, ids)
CanonicalLogits.feed_rows = counting
with Archive(sys.argv[1], model=lm) as arc:
    arc.canonical()
    start = time.perf_counter()
    got = {e["id"]: r for e, r in arc.restore_many(arc.sessions)}
    seconds = time.perf_counter() - start
digest = hashlib.sha256()
for sid in sorted(got):
    cap = got[sid]
    digest.update(cap.tokens.numpy().tobytes())
    for t in [*cap.keys, *cap.values]:
        digest.update(t.contiguous().view(torch.uint8).numpy().tobytes())
positions = sum(c.positions for c in got.values())
print(json.dumps({"passes": passes[0], "rows": rows[0], "seconds": round(seconds, 2),
                  "sessions": len(got), "positions": positions, "sha256": digest.hexdigest()}))
"""


def measure(code_root: Path, archive: Path, model: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(code_root))
    out = subprocess.run(
        [sys.executable, "-c", MEASURE, str(archive), model],
        env=env,
        cwd=code_root,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    parser = harness.parser(__doc__, model=False)
    parser.add_argument("--sessions", type=int, default=24, help="branches (x2 continuations)")
    parser.add_argument("--model", help="model folder or .gguf (default: the tiny model)")
    parser.add_argument("--compare", metavar="REV", help="also restore with seqkv at REV")
    args = parser.parse_args(argv)
    harness.start(args, load=False)  # the model is built or loaded in build()

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        archive, model = build(folder, args.sessions, args.model)
        result = {"environment": harness.environment(), "command": harness.command_line()}
        result["now"] = measure(ROOT, archive, model)
        if args.compare:
            tree = folder / "before"
            subprocess.run(
                ["git", "worktree", "add", "--detach", str(tree), args.compare],
                cwd=ROOT,
                check=True,
                capture_output=True,
            )
            try:
                result["before"] = measure(tree, archive, model)
                result["before"]["revision"] = args.compare
            finally:
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT)
            if result["before"]["sha256"] != result["now"]["sha256"]:
                raise SystemExit("the two restores differ: continuous batching changed output")
    harness.publish(result, json.dumps(result, indent=1), args.json, args.append)
    return result


if __name__ == "__main__":
    _, seconds = harness.timed(main)
    print(f"({seconds:.0f} s)", file=sys.stderr)
