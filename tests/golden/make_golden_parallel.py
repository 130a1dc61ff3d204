"""Write a golden chunk-parallel `seq` file (`compress --parallel 3`) ONCE per SKPS version.

It holds sessions `a` and `b` of seq-portable-v1/ (their captures and the tiny model of
seq-v1/), each coded as 3 runs on portable-fx53-v1, flat layout, in the token-run framing
this seqkv writes: parallel-v1/ was written with SKPS version 1, parallel-v2/ with version 2
(one shared header). Never re-run this into an existing folder to make a failing golden test
pass. Usage: python -m tests.golden.make_golden_parallel OUT_DIR
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

from seqkv_cli.archive import compress_captures
from seqkv_cli.runtime.numerics import PORTABLE

HERE = Path(__file__).resolve().parent
CAPTURES = [HERE / "seq-portable-v1" / "captures" / f"{s}.safetensors" for s in ("a", "b")]
MODEL = HERE / "seq-v1" / "model"
SPEC = {"id": "seq", "numerics": PORTABLE, "parallel": 3}


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "seq-parallel3.skv"
    res = compress_captures(CAPTURES, path, codec=SPEC, model=str(MODEL), layout="flat")
    data = path.read_bytes()
    expected = {"bytes": res.file_bytes, "sha256": hashlib.sha256(data).hexdigest(), "spec": SPEC}
    (out / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
