"""One compress or decompress in a fresh process, so its peak RSS can be read alone.

    python bench/suite/_child.py import
    python bench/suite/_child.py model MODEL
    python bench/suite/_child.py compress MODEL CODEC OUT.skv CAPTURE...
    python bench/suite/_child.py decompress MODEL IN.skv OUTDIR

MODEL is "-" for the embedded model, a model folder, or "none" (per-vector codecs need
no model). Prints one JSON line: the op's wall-clock seconds (model loading excluded) and
this process's peak resident memory.

Peak memory is VmHWM from /proc/self/status: the high-water mark of this process's own
address space. `ru_maxrss` (RUSAGE_CHILDREN, or `os.wait4`) is no use here: Linux carries the
forking parent's high-water mark into the child at exec, so every child of a 1 GiB parent
reports at least 1 GiB.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def main(argv: list[str]) -> None:
    op, args = argv[0], argv[1:]
    import torch  # noqa: F401  (every op below pays for torch; the baseline shows how much)

    import seqkv_cli  # noqa: F401

    lm = None
    if op != "import" and args[0] != "none":
        from seqkv_cli.kvcapture.engine import canonical_model
        from seqkv_cli.runtime.loading import load_model

        lm = load_model(None if args[0] == "-" else args[0])
        canonical_model(lm)
    start = time.perf_counter()
    if op == "compress":
        from seqkv_cli.archive import compress_captures

        codec, out, captures = args[1], Path(args[2]), [Path(p) for p in args[3:]]
        compress_captures(captures, out, codec=codec, model=lm, check=False)
    elif op == "decompress":
        from seqkv_cli.archive import decompress

        decompress(Path(args[1]), Path(args[2]), model=lm)
    elif op not in ("import", "model"):
        raise SystemExit(f"unknown op {op!r}")
    seconds = time.perf_counter() - start
    print(json.dumps({"op": op, "seconds": seconds, "peak_rss_kib": peak_kib()}))


def peak_kib() -> int:
    """VmHWM of this process (Linux); elsewhere ru_maxrss, which may include the parent's."""
    import resource

    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


if __name__ == "__main__":
    main(sys.argv[1:])
