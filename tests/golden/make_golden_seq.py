"""Write golden `seq` / `seq-fast` files ONCE, with the tiny model they were coded under.

Model-coded files need the exact model: the tiny random model is stored beside them (so the
goldens do not depend on torch's random generator), with the capture they restore to. Never
re-run this to make a failing golden test pass; a new numeric path gets new goldens beside the
old ones. Usage: python -m tests.golden.make_golden_seq OUT_DIR [NUMERICS [MODEL_DIR]]
(seq-v1/ was written by de81bf6 on the legacy path; seq-portable-v1/ on portable-fx53-v1;
seq-portable-v2/ on portable-fx53-v2 and seq-portable-v3/ on portable-fx53-v3 (seqkv 0.5), both
with MODEL_DIR tests/golden/seq-v1/model.)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from seqkv_cli.archive import compress_captures
from seqkv_cli.kvcapture.api import capture
from tests.conftest import build_tiny_model

TEXT = (
    "Sequential coding stores what a model can predict in few bits: the tokens, coded "
    "under its own next-token distribution, and recomputes the rest. "
)
FILES = {"seq-trie": ("seq", "trie"), "seq-flat": ("seq", "flat"), "seq-fast": ("seq-fast", "trie")}


def main(out: Path, numerics: str | None = None, model: Path | None = None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    if model is None:  # seq-portable-v1 reads ../seq-v1/model
        model = build_tiny_model(out / "model", seed=7)
    (out / "a.txt").write_text(TEXT * 2)
    (out / "b.txt").write_text(TEXT + "A second session branches off here.")
    inputs = [str(out / "a.txt"), str(out / "b.txt")]
    kwargs = {"numerics": numerics} if numerics else {}  # de81bf6 had no numerics argument
    results = capture(inputs, out=out / "captures", model=str(model), **kwargs)
    paths = [r.path for r in results]
    expected = {}
    for name, (codec, layout) in FILES.items():
        spec = {"id": codec, "numerics": numerics} if numerics else codec
        res = compress_captures(
            paths, out / f"{name}.skv", codec=spec, model=str(model), layout=layout
        )
        expected[name] = {"codec": codec, "layout": layout, "bytes": res.file_bytes}
    (out / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")


if __name__ == "__main__":
    args = sys.argv[1:] + [None] * (3 - len(sys.argv[1:]))
    main(Path(args[0]), args[1], Path(args[2]) if args[2] else None)
