"""Write the golden files of format 1.6 (binary records after the first, trie tables version 2)
ONCE.

The two canonical captures of ../seq-portable-v3 compressed with `seq` as a trie ("a"), then
grown by `archive add` ("b"), and the same two sessions' tokens kept through the library API
one `add` at a time, as an agent's turns are: a trie whose later segments inherit their
profile and store their creation time as seconds after the one before. A reader must keep
restoring them bit for bit. Never re-run this to make a failing golden test pass. Uses the
tiny model stored in ../seq-v1/model.
Usage: python -m tests.golden.make_golden_records tests/golden/records-v1
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from seqkv_cli.archive import add_captures, compress_captures
from seqkv_cli.kvcapture.capture_file import load_capture

HERE = Path(__file__).resolve().parent
MODEL = HERE / "seq-v1" / "model"
CAPTURES = HERE / "seq-portable-v3" / "captures"


def main(out: Path) -> None:
    import seqkv_cli as seqkv

    out.mkdir(parents=True, exist_ok=True)
    expected = {}
    appended = out / "seq-appended.skv"
    compress_captures(
        [CAPTURES / "a.safetensors"], appended, codec="seq", model=str(MODEL), layout="trie"
    )
    add_captures(appended, [CAPTURES / "b.safetensors"], model=str(MODEL))
    expected["seq-appended"] = {"bytes": appended.stat().st_size, "sessions": ["a", "b"]}
    turns = out / "api-turns.skv"
    tokens = load_capture(CAPTURES / "b.safetensors").tokens.tolist()
    cuts = [len(tokens) // 3, 2 * len(tokens) // 3, len(tokens)]
    with seqkv.open_archive(turns, model=str(MODEL)) as arc:
        for k, cut in enumerate(cuts, 1):
            os.environ["SOURCE_DATE_EPOCH"] = str(1796000000 + 7 * k)  # seconds apart
            arc.add(f"agent/turn-{k}", tokens[:cut])
    expected["api-turns"] = {
        "bytes": turns.stat().st_size,
        "sessions": [f"agent/turn-{k}" for k in range(1, 4)],
        "tokens": cuts,
    }
    (out / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
