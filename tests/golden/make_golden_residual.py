"""Write the golden files of the rounding-modelled residual (`SKR2`) ONCE.

A capture that is not canonical (the tiny model's ordinary transformers forward, stored as
bf16) needs a residual against the recompute; these files hold it as `SKR2` parts, so a
reader must keep restoring that capture bit for bit from them. Never re-run this to make a
failing golden test pass. Uses the tiny model stored in ../seq-v1/model.
Usage: python -m tests.golden.make_golden_residual tests/golden/residual-skr2-v2 (stream
version 2, seqkv 0.3; residual-skr2-v1 holds version-1 streams written by seqkv 0.2)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from seqkv_cli.archive import compress_captures
from seqkv_cli.kvcapture.api import capture

MODEL = Path(__file__).resolve().parent / "seq-v1" / "model"
TEXT = "A cache from the user's own run differs from the recompute by rounding noise. " * 2
FILES = {"seq-trie": "trie", "seq-flat": "flat"}


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "a.txt").write_text(TEXT)
    [result] = capture(
        [str(out / "a.txt")], out=out / "captures", model=str(MODEL), canonical=False
    )
    expected = {}
    for name, layout in FILES.items():
        res = compress_captures(
            [result.path], out / f"{name}.skv", codec="seq", model=str(MODEL), layout=layout
        )
        expected[name] = {"layout": layout, "bytes": res.file_bytes}
    (out / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
