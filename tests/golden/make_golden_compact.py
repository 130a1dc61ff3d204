"""Write the golden compact single-session files ONCE.

They hold session `a` of a seq-portable-* golden (its capture and the tiny model of seq-v1/),
coded with `seq` and `seq-fast` on that capture's numeric path: compact-v1/ (format 1.2) from
seq-portable-v1/, compact-v3/ (format 1.5, seqkv 0.5) from seq-portable-v3/. Never re-run this
to make a failing golden test pass. Usage:
python -m tests.golden.make_golden_compact OUT_DIR [SEQ_GOLDEN_DIR (default seq-portable-v1)]
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

from seqkv_cli.archive import compress_captures

HERE = Path(__file__).resolve().parent
MODEL = HERE / "seq-v1" / "model"


def main(out: Path, source: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    capture = source / "captures" / "a.safetensors"
    expected = {}
    for codec in ("seq", "seq-fast"):
        path = out / f"{codec}.skv"
        res = compress_captures([capture], path, codec=codec, model=str(MODEL), layout="compact")
        data = path.read_bytes()
        expected[codec] = {"bytes": res.file_bytes, "sha256": hashlib.sha256(data).hexdigest()}
    (out / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]) if len(sys.argv) > 2 else HERE / "seq-portable-v1")
