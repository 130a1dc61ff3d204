"""Write the golden compact archives (format 1.8) ONCE.

"captures": ../seq-portable-v3's captures a and b compressed with `--layout compact` (`seq`).
"turns-small" / "turns-fast": the tokens of capture b kept through the library API one turn
at a time (four turns, as ../load-modes-v1 keeps them), then `archive compact`: the chain of
turns is one node, three sessions end inside it. A reader must keep restoring them bit for
bit. Never re-run this to make a failing golden test pass. Uses the tiny model stored in
../seq-v1/model. Usage:
python -m tests.golden.make_golden_compact_archive tests/golden/compact-archive-v1
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

from seqkv_cli.kvcapture.capture_file import load_capture

HERE = Path(__file__).resolve().parent
MODEL = HERE / "seq-v1" / "model"
CAPTURES = HERE / "seq-portable-v3" / "captures"
TURNS = 4


def main(out: Path) -> None:
    import seqkv_cli as seqkv
    from seqkv_cli.archive import compact, compress_captures

    out.mkdir(parents=True, exist_ok=True)
    expected = {}
    path = out / "captures.skv"
    compress_captures(
        [CAPTURES / "a.safetensors", CAPTURES / "b.safetensors"],
        path,
        codec="seq",
        model=str(MODEL),
        layout="compact",
    )
    expected["captures"] = {"sessions": ["a", "b"]}
    tokens = load_capture(CAPTURES / "b.safetensors").tokens.tolist()
    cuts = [len(tokens) * k // TURNS for k in range(1, TURNS + 1)]
    for mode in ("small", "fast"):
        path = out / f"turns-{mode}.skv"
        with seqkv.open_archive(path, model=str(MODEL), load=mode) as arc:
            for k, cut in enumerate(cuts, 1):
                arc.add(f"agent/turn-{k}", tokens[:cut])
        compact(path, model=str(MODEL))
        expected[f"turns-{mode}"] = {
            "sessions": [f"agent/turn-{k}" for k in range(1, TURNS + 1)],
            "tokens": cuts,
        }
    for name, entry in expected.items():
        data = (out / f"{name}.skv").read_bytes()
        entry.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    (out / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
