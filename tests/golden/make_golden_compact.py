"""Write the golden compact single-session files (format 1.2) ONCE.

They hold session `a` of seq-portable-v1/ (its capture and the tiny model of seq-v1/), coded
with `seq` and `seq-fast` on portable-fx53-v1. Never re-run this to make a failing golden test
pass. Usage: python tests/golden/make_golden_compact.py OUT_DIR
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

from seqkv_cli.skv.compress import compress_captures

HERE = Path(__file__).resolve().parent
CAPTURE = HERE / "seq-portable-v1" / "captures" / "a.safetensors"
MODEL = HERE / "seq-v1" / "model"


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    expected = {}
    for codec in ("seq", "seq-fast"):
        path = out / f"{codec}.skv"
        res = compress_captures([CAPTURE], path, codec=codec, model=str(MODEL), layout="compact")
        data = path.read_bytes()
        expected[codec] = {"bytes": res.file_bytes, "sha256": hashlib.sha256(data).hexdigest()}
    (out / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
