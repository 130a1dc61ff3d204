"""Per-vector codecs on real KV of the embedded model, next to zstd, plus the entropy coder.

Usage (the command recorded in docs/BENCHMARKS.md):
    python bench/bench_codecs.py --append docs/BENCHMARKS.md --json bench/results/codecs.json

Without --captures it captures sample_data/prose.txt and sample_data/sample_code.py with the
embedded model (canonical numerics, bf16) first.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import zstandard

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_entropy import markdown as entropy_markdown  # noqa: E402
from bench_entropy import run as entropy_run  # noqa: E402

CODECS = ("raw", "lossless", "int8", "kivi4", "kivi2", "turbo4", "turbo3")


def load_blocks(paths: list[Path]):
    from seqkv_cli import load_capture
    from seqkv_cli.kvcapture.blocks import to_block

    blocks, positions = [], 0
    for path in paths:
        cap = load_capture(path)
        positions += cap.positions
        for kind, tensors in (("key", cap.keys), ("value", cap.values)):
            blocks += [to_block(t, cap.meta["dtype"], kind) for t in tensors]
    return blocks, positions


def timed(fn, items):
    start = time.perf_counter()
    out = [fn(x) for x in items]
    return out, time.perf_counter() - start


def bench_codec(codec_id: str, blocks) -> dict:
    from seqkv_codecs.registry import get_codec

    codec = get_codec(codec_id)
    encoded, t_enc = timed(codec.encode, blocks)
    decoded, t_dec = timed(codec.decode, encoded)
    num = den = 0.0
    for a, b in zip(blocks, decoded, strict=True):
        x, y = a.to_float32().astype(np.float64), b.to_float32().astype(np.float64)
        num += float(((x - y) ** 2).sum())
        den += float((x**2).sum())
    return summary(
        codec_id,
        "lossless" if codec.lossless else "lossy",
        blocks,
        sum(len(e) for e in encoded),
        t_enc,
        t_dec,
        (num / den) ** 0.5,
    )


def bench_zstd(level: int, split: bool, blocks) -> dict:
    cctx, dctx = zstandard.ZstdCompressor(level=level), zstandard.ZstdDecompressor()

    def planes(block):
        raw = np.ascontiguousarray(block.data).view(np.uint8)
        if not split:
            return [raw.tobytes()]
        width = block.data.dtype.itemsize
        return [raw.reshape(-1, width)[:, i].tobytes() for i in range(width)]

    inputs = [planes(b) for b in blocks]
    encoded, t_enc = timed(lambda ps: [cctx.compress(p) for p in ps], inputs)
    _, t_dec = timed(lambda es: [dctx.decompress(e) for e in es], encoded)
    name = f"zstd -{level}" + (" byte-planes" if split else "")
    return summary(
        name, "lossless", blocks, sum(len(e) for es in encoded for e in es), t_enc, t_dec, 0.0
    )


def summary(name, kind, blocks, out_bytes, t_enc, t_dec, rel) -> dict:
    in_bytes = sum(b.nbytes for b in blocks)
    comps = sum(b.num_components for b in blocks)
    return {
        "codec": name,
        "kind": kind,
        "input_bytes": in_bytes,
        "output_bytes": out_bytes,
        "ratio": in_bytes / out_bytes,
        "bits_per_component": out_bytes * 8 / comps,
        "encode_MBps": in_bytes / t_enc / 1e6,
        "decode_MBps": in_bytes / t_dec / 1e6,
        "rel_l2_error": rel,
    }


def codec_markdown(rows: list[dict], positions: int) -> str:
    lines = [
        "| codec | kind | ratio vs bf16 | bits/component | bits/position | encode MB/s "
        "| decode MB/s | rel. L2 error |",
        "|" + " --- |" * 8,
    ]
    comps_per_pos = rows[0]["input_bytes"] / 2 / positions
    for r in rows:
        lines.append(
            f"| {r['codec']} | {r['kind']} | {r['ratio']:.2f}x | {r['bits_per_component']:.2f} "
            f"| {r['bits_per_component'] * comps_per_pos:,.0f} | {r['encode_MBps']:.1f} "
            f"| {r['decode_MBps']:.1f} | {r['rel_l2_error']:.4f} |"
        )
    return "\n".join(lines)


def capture_defaults(folder: Path) -> list[Path]:
    from seqkv_cli import capture

    inputs = [str(ROOT / "sample_data" / "prose.txt"), str(ROOT / "sample_data" / "sample_code.py")]
    return [r.path for r in capture(inputs, out=folder)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--captures",
        nargs="*",
        type=Path,
        help="capture files (default: capture two sample_data files with the embedded model)",
    )
    parser.add_argument("--entropy-size-mb", type=float, default=16.0)
    parser.add_argument("--threads", type=int, default=1, help="torch/numpy threads")
    parser.add_argument("--json", type=Path, help="write raw numbers here")
    parser.add_argument("--append", type=Path, help="append the Markdown report to this file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        paths = args.captures or capture_defaults(Path(tmp))
        blocks, positions = load_blocks(paths)
        rows = [bench_codec(c, blocks) for c in CODECS]
        rows += [
            bench_zstd(3, False, blocks),
            bench_zstd(19, False, blocks),
            bench_zstd(19, True, blocks),
        ]
    entropy_rows = entropy_run(args.entropy_size_mb, 2, None)
    command = "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]])
    head = (
        f"## Per-vector codecs and entropy coder — {dt.date.today().isoformat()}\n\n"
        f"Machine: {platform.machine()}, {torch.get_num_threads()} thread(s) "
        f"(`{platform.processor() or platform.platform()}`), Python "
        f"{platform.python_version()}, torch {torch.__version__}, numpy {np.__version__}, "
        f"zstandard {zstandard.__version__}.\nCommand: `{command}`\n\n"
        f"K/V of {positions:,} positions ({len(paths)} captures, embedded model, bf16, "
        f"{sum(b.nbytes for b in blocks) / 1e6:.1f} MB):\n\n"
    )
    report = (
        head + codec_markdown(rows, positions) + "\n\nEntropy coder alone "
        f"({args.entropy_size_mb:g} MiB of symbols per dataset):\n\n"
        + entropy_markdown(entropy_rows)
        + "\n"
    )
    print(report)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "codecs": rows,
                    "entropy": entropy_rows,
                    "positions": positions,
                    "command": command,
                },
                indent=2,
            )
        )
    if args.append:
        with open(args.append, "a", encoding="utf-8") as f:
            f.write("\n" + report)


if __name__ == "__main__":
    main()
