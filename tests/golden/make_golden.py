"""Write the golden files ONCE: a synthetic capture and one .skv per codec.

Never re-run this to make a failing golden test pass: a golden file that stops decoding to the
recorded bytes means the format changed, which needs a version bump and new goldens *beside*
the old ones (tests/golden/v<N>/...). Usage: python tests/golden/make_golden.py OUT_DIR
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch

from seqkv_cli.archive import Archive, compress_captures
from seqkv_cli.kvcapture.capture_file import Capture, save_capture

CODECS = ("raw", "lossless", "int8", "kivi2", "kivi4", "turbo3", "turbo4")


def synthetic_capture() -> Capture:
    gen = torch.Generator().manual_seed(2026)
    layers, heads, n, dim = 2, 2, 160, 16  # n > 128: past the KIVI fp16 window
    channel_scale = torch.logspace(-1, 1, dim)  # KV channels differ in magnitude
    keys = [
        (torch.randn(heads, n, dim, generator=gen) * channel_scale).bfloat16()
        for _ in range(layers)
    ]
    values = [torch.randn(heads, n, dim, generator=gen).bfloat16() for _ in range(layers)]
    tokens = torch.randint(0, 1000, (n,), generator=gen)
    surprisal = torch.rand(n - 1, generator=gen, dtype=torch.float64) * 8
    meta = {
        "session_id": "golden",
        "source": "synthetic",
        "model_name": "synthetic",
        "model_fingerprint": "0" * 64,
        "tokenizer_fingerprint": "0" * 64,
        "dtype": "bf16",
        "numeric_path": "synthetic",
        "num_layers": layers,
        "num_kv_heads": heads,
        "head_dim": dim,
        "positions": n,
    }
    return Capture(tokens, keys, values, surprisal, meta)


def digest(cap: Capture) -> str:
    h = hashlib.sha256()
    for t in (*cap.keys, *cap.values):
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    save_capture(synthetic_capture(), out / "capture.safetensors")
    expected = {}
    for codec in CODECS:
        path = out / f"{codec}.skv"
        compress_captures([out / "capture.safetensors"], path, codec=codec)
        with Archive(path) as arc:
            expected[codec] = digest(arc.restore(arc.sessions[0]))
    (out / "expected.json").write_text(json.dumps(expected, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
