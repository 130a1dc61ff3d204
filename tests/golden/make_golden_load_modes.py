"""Write the golden files of format 1.7 (load modes per segment, packed ids) ONCE.

The tokens of ../seq-portable-v3's capture "b" kept through the library API one turn at a
time, as an agent's turns are: "mixed-turns" is a `seq` archive whose second and fourth turns
were added with load="fast" (their segments name `seq-fast` and store packed ids); "fast-turns"
an archive opened with load="fast" (its header codec `seq-fast`, packed ids from the first
segment on). A reader must keep restoring them bit for bit. Never re-run this to make a
failing golden test pass. Uses the tiny model stored in ../seq-v1/model.
Usage: python -m tests.golden.make_golden_load_modes tests/golden/load-modes-v1
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from seqkv_cli.kvcapture.capture_file import load_capture

HERE = Path(__file__).resolve().parent
MODEL = HERE / "seq-v1" / "model"
CAPTURES = HERE / "seq-portable-v3" / "captures"
MODES = ["small", "fast", "small", "fast"]


def main(out: Path) -> None:
    import seqkv_cli as seqkv

    out.mkdir(parents=True, exist_ok=True)
    tokens = load_capture(CAPTURES / "b.safetensors").tokens.tolist()
    cuts = [len(tokens) * k // len(MODES) for k in range(1, len(MODES) + 1)]
    expected = {}
    for name, default, modes in (
        ("mixed-turns", None, MODES),
        ("fast-turns", "fast", [None] * len(MODES)),
    ):
        path = out / f"{name}.skv"
        with seqkv.open_archive(path, model=str(MODEL), load=default) as arc:
            for k, (cut, mode) in enumerate(zip(cuts, modes, strict=True), 1):
                os.environ["SOURCE_DATE_EPOCH"] = str(1796100000 + 5 * k)
                arc.add(f"agent/turn-{k}", tokens[:cut], load=mode)
        expected[name] = {
            "bytes": path.stat().st_size,
            "sessions": [f"agent/turn-{k}" for k in range(1, len(MODES) + 1)],
            "tokens": cuts,
        }
    (out / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
