"""seq vs delta-topk (arXiv 2604.15356 Layer 2) on real K/V of the embedded model.

Usage:
    python bench/bench_delta_topk.py --tokens 256 --json bench/results/delta_topk.json

Captures sample_data/prose.txt (first --tokens tokens, canonical numerics, bf16), then runs
every session codec through a full encode and decode and reports bits per position (tokens /
residual), relative L2 and max abs error of the restored K/V, and wall-clock seconds. For
reference it adds the same surprisal-adaptive quantizer without a predictor (KV̂ = 0; no model
needed, tokens not counted) and two per-vector codecs.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = [
    {"id": "seq"},
    {"id": "seq-fast"},
    *({"id": "delta-topk", "variant": "topk", "k": 20, "max_bits": b} for b in (0, 2, 4, 8)),
    {"id": "delta-topk", "variant": "topk", "k": 20, "max_bits": 4, "base": 4.0, "slope": 0.0},
    *({"id": "delta-topk", "variant": "linear", "max_bits": b} for b in (0, 4, 8)),
]


def errors(cap, restored) -> tuple[float, float]:
    from seqkv_cli.sequential.delta_topk import flatten_kv

    a = flatten_kv(cap.keys, cap.values).double()
    b = flatten_kv(restored.keys, restored.values).double()
    return float((a - b).norm() / a.norm()), float((a - b).abs().max())


def run_session_codec(config: dict, cap, canon) -> dict:
    from seqkv_cli.sequential.registry import session_codec_class

    codec = session_codec_class(config["id"]).from_config(config)
    start = time.perf_counter()
    enc = codec.encode(cap, canon)
    t_enc = time.perf_counter() - start
    entry = {"id": cap.session_id, "positions": cap.positions, "dtype": cap.meta["dtype"]}
    start = time.perf_counter()
    restored = codec.decode(entry, enc.parts.get, canon)
    t_dec = time.perf_counter() - start
    if not torch.equal(restored.tokens, cap.tokens):
        raise SystemExit(f"{config}: tokens did not round-trip")
    n = cap.positions
    token_bytes = len(enc.parts["tokens.seq"])
    other = sum(len(v) for k, v in enc.parts.items() if k != "tokens.seq")
    rel, max_abs = errors(cap, restored)
    name = config["id"] + "".join(f" {k}={v}" for k, v in config.items() if k != "id")
    return row(name, token_bytes * 8 / n, other * 8 / n, rel, max_abs, t_enc, t_dec, enc.notes)


def run_no_predictor(cap, max_bits: int, vocab: int) -> dict:
    """The quantizer alone on the K/V itself: what the predictor has to beat."""
    from seqkv_cli.sequential.delta_topk import flatten_kv
    from seqkv_codecs.adaptive_quant import bits_from_surprisal, dequantize, quantize

    kv = flatten_kv(cap.keys, cap.values).numpy()
    s = np.concatenate([[np.log2(vocab)], cap.surprisal.numpy()])
    bits = bits_from_surprisal(s, base=2.0, slope=1.0, max_bits=max_bits)
    start = time.perf_counter()
    data = quantize(kv, bits, cap.keys[0].shape[-1], max_bits)
    t_enc = time.perf_counter() - start
    start = time.perf_counter()
    out = dequantize(data).values
    t_dec = time.perf_counter() - start
    err = kv.astype(np.float64) - out
    rel = float(np.linalg.norm(err) / np.linalg.norm(kv.astype(np.float64)))
    n = cap.positions
    name = f"adaptive quant alone (KV̂ = 0), max_bits={max_bits}"
    return row(name, 0.0, len(data) * 8 / n, rel, float(np.abs(err).max()), t_enc, t_dec, [])


def run_pervector(cap, codec_id: str) -> dict:
    from seqkv_cli.kvcapture.blocks import to_block, to_tensor
    from seqkv_cli.kvcapture.capture_file import Capture
    from seqkv_codecs.registry import get_codec

    codec, size, t_enc, t_dec, out = get_codec(codec_id), 0, 0.0, 0.0, {}
    for kind, tensors in (("key", cap.keys), ("value", cap.values)):
        for t in tensors:
            start = time.perf_counter()
            data = codec.encode(to_block(t, cap.meta["dtype"], kind))
            t_enc += time.perf_counter() - start
            start = time.perf_counter()
            out.setdefault(kind, []).append(to_tensor(codec.decode(data)))
            t_dec += time.perf_counter() - start
            size += len(data)
    restored = Capture(cap.tokens, out["key"], out["value"], cap.surprisal, {})
    rel, max_abs = errors(cap, restored)
    n = cap.positions
    return row(f"{codec_id} (per-vector)", 0.0, size * 8 / n, rel, max_abs, t_enc, t_dec, [])


def row(name, token_bits, residual_bits, rel, max_abs, t_enc, t_dec, notes) -> dict:
    return {
        "codec": name,
        "token_bits_per_position": token_bits,
        "residual_bits_per_position": residual_bits,
        "bits_per_position": token_bits + residual_bits,
        "rel_l2_error": rel,
        "max_abs_error": max_abs,
        "encode_s": t_enc,
        "decode_s": t_dec,
        "notes": notes,
    }


def markdown(rows: list[dict]) -> str:
    lines = [
        "| codec | bits/pos tokens | bits/pos residual | bits/pos total | rel. L2 error "
        "| max abs error | encode s | decode s |",
        "|" + " --- |" * 8,
    ]
    for r in rows:
        lines.append(
            f"| {r['codec']} | {r['token_bits_per_position']:.2f} "
            f"| {r['residual_bits_per_position']:,.1f} | {r['bits_per_position']:,.1f} "
            f"| {r['rel_l2_error']:.4f} | {r['max_abs_error']:.4f} | {r['encode_s']:.1f} "
            f"| {r['decode_s']:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    from seqkv_cli import capture
    from seqkv_cli.kvcapture.engine import canonical_model
    from seqkv_cli.runtime.loading import load_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256, help="positions of prose.txt to use")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--json", type=Path, help="write raw numbers here")
    parser.add_argument("--append", type=Path, help="append the Markdown report to this file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    lm = load_model()
    canon = canonical_model(lm)
    with tempfile.TemporaryDirectory() as tmp:
        [res] = capture(
            [str(ROOT / "sample_data" / "prose.txt")],
            model=lm,
            out=Path(tmp),
            max_tokens=args.tokens,
        )
    cap = res.capture
    rows = [run_session_codec(c, cap, canon) for c in CONFIGS]
    rows += [run_no_predictor(cap, b, canon.vocab_size) for b in (2, 4, 8)]
    rows += [run_pervector(cap, c) for c in ("kivi2", "turbo3")]
    command = "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]])
    report = (
        f"## delta-topk (paper's Layer 2) vs seq and per-vector codecs — "
        f"{dt.date.today().isoformat()}\n\n"
        f"K/V of {cap.positions} positions of sample_data/prose.txt, embedded model, bf16 "
        f"(log2 PP {cap.log2_ppl:.2f} bits); {torch.get_num_threads()} thread(s), "
        f"{platform.machine()}, torch {torch.__version__}.\nCommand: `{command}`\n\n"
        + markdown(rows)
    )
    notes = [f"- {r['codec']}: {note}" for r in rows for note in r["notes"]]
    report = "\n".join([report, "", *notes, ""])
    print(report)
    if args.append:
        with open(args.append, "a", encoding="utf-8") as f:
            f.write("\n" + report)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {"positions": cap.positions, "log2_ppl": cap.log2_ppl, "rows": rows}
        tmp = args.json.with_name(f".{args.json.name}.tmp")
        tmp.write_text(json.dumps({**payload, "command": command}, indent=2))
        os.replace(tmp, args.json)


if __name__ == "__main__":
    main()
