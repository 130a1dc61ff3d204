"""Per-vector codecs on real KV of the embedded model, next to zstd, plus the entropy coder.

Usage (the command recorded in docs/BENCHMARKS.md):
    python -m bench.studies.codecs --append docs/BENCHMARKS_LOG.md --json bench/results/codecs.json

Without --captures it captures sample_data/prose.txt and sample_data/sample_code.py with the
embedded model (or --model; canonical numerics, bf16) first.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import zstandard

from bench import harness
from bench.harness import SAMPLE
from bench.studies.entropy import markdown as entropy_markdown
from bench.studies.entropy import run as entropy_run
from bench.table import table

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
    """`fn` over every item, and the seconds of them all."""
    return harness.timed(lambda: [fn(x) for x in items])


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
    comps_per_pos = rows[0]["input_bytes"] / 2 / positions
    head = [
        "codec", "kind", "ratio vs bf16", "bits/component", "bits/position", "encode MB/s",
        "decode MB/s", "rel. L2 error",
    ]  # fmt: skip
    cells = [
        [r["codec"], r["kind"], f"{r['ratio']:.2f}x", f"{r['bits_per_component']:.2f}",
         f"{r['bits_per_component'] * comps_per_pos:,.0f}", f"{r['encode_MBps']:.1f}",
         f"{r['decode_MBps']:.1f}", f"{r['rel_l2_error']:.4f}"]
        for r in rows
    ]  # fmt: skip
    return "\n".join(table(head, cells))


def capture_defaults(folder: Path, lm) -> list[Path]:
    from seqkv_cli import capture

    inputs = [str(SAMPLE / "prose.txt"), str(SAMPLE / "sample_code.py")]
    return [r.path for r in capture(inputs, model=lm, out=folder)]


def main(argv: list[str] | None = None) -> dict:
    parser = harness.parser(__doc__, threads=1)
    parser.add_argument(
        "--captures",
        nargs="*",
        type=Path,
        help="capture files (default: capture two sample_data files with the embedded model)",
    )
    parser.add_argument("--entropy-size-mb", type=float, default=16.0)
    args = parser.parse_args(argv)
    lm = harness.start(args, load=not args.captures)  # given captures need no model
    with tempfile.TemporaryDirectory() as tmp:
        paths = args.captures or capture_defaults(Path(tmp), lm)
        blocks, positions = load_blocks(paths)
        rows = [bench_codec(c, blocks) for c in CODECS]
        rows += [
            bench_zstd(3, False, blocks),
            bench_zstd(19, False, blocks),
            bench_zstd(19, True, blocks),
        ]
    entropy_rows = entropy_run(args.entropy_size_mb, 2, None)
    fields = {"codecs": rows, "entropy": entropy_rows, "positions": positions}
    fields |= {"captures": len(paths), "kv_bytes": sum(b.nbytes for b in blocks)}
    fields["entropy_size_mb"] = args.entropy_size_mb
    return harness.finish(args, lm, markdown, **fields)


def markdown(result: dict) -> str:
    positions = result["positions"]
    return "\n".join(
        [
            *harness.heading("Per-vector codecs and entropy coder", result),
            f"K/V of {positions:,} positions ({result['captures']} captures, bf16, "
            f"{result['kv_bytes'] / 1e6:.1f} MB):",
            "",
            codec_markdown(result["codecs"], positions),
            "",
            f"Entropy coder alone ({result['entropy_size_mb']:g} MiB of symbols per dataset):",
            "",
            entropy_markdown(result["entropy"]),
            "",
        ]
    )
