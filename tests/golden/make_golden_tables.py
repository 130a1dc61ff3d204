"""Write the golden files of format 1.4 (binary section tables, `SKS1` surprisal) ONCE.

The foreign capture of ../residual-skr2-v2 (a non-canonical capture: its residual parts are
what made JSON section tables cost more than the parts, and its own surprisal is stored
against the recompute's as `SKS1`) compressed with `seq` as a trie and a
flat file, and a trie file grown by one `archive add` (two index records, both binary). A
reader must keep restoring them bit for bit. Never re-run this to make a failing golden test
pass. Uses the tiny model stored in ../seq-v1/model.
Usage: python -m tests.golden.make_golden_tables tests/golden/tables-v1
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from seqkv_cli.archive import add_captures, compress_captures

HERE = Path(__file__).resolve().parent
MODEL = HERE / "seq-v1" / "model"
FOREIGN = HERE / "residual-skr2-v2" / "captures" / "a.safetensors"
CANONICAL = HERE / "seq-portable-v2" / "captures" / "b.safetensors"  # session "b"


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    expected = {}
    for name, layout in (("seq-trie", "trie"), ("seq-flat", "flat")):
        res = compress_captures(
            [FOREIGN], out / f"{name}.skv", codec="seq", model=str(MODEL), layout=layout
        )
        expected[name] = {"layout": layout, "bytes": res.file_bytes, "sessions": ["a"]}
    compress_captures(
        [FOREIGN], out / "seq-appended.skv", codec="seq", model=str(MODEL), layout="trie"
    )
    add_captures(out / "seq-appended.skv", [CANONICAL], model=str(MODEL))
    expected["seq-appended"] = {
        "layout": "trie",
        "bytes": (out / "seq-appended.skv").stat().st_size,
        "sessions": ["a", "b"],
    }
    (out / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
