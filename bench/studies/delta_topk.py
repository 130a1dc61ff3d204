"""seq vs delta-topk (arXiv 2604.15356 Layer 2) on real K/V of the embedded model.

Usage:
    python -m bench.studies.delta_topk --tokens 256 --json bench/results/delta_topk.json

Captures sample_data/prose.txt (first --tokens tokens, canonical numerics, bf16), then runs
every session codec through a full encode and decode and reports bits per position (tokens /
residual), relative L2 and max abs error of the restored K/V, and wall-clock seconds. For
reference it adds the same surprisal-adaptive quantizer without a predictor (KV̂ = 0; no model
needed, tokens not counted) and two per-vector codecs.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch

from bench import harness
from bench.harness import SAMPLE, timed
from bench.table import table

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
    enc, t_enc = timed(lambda: codec.encode(cap, canon))
    entry = {"id": cap.session_id, "positions": cap.positions, "dtype": cap.meta["dtype"]}
    restored, t_dec = timed(lambda: codec.decode(entry, enc.parts.get, canon))
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
    data, t_enc = timed(lambda: quantize(kv, bits, cap.keys[0].shape[-1], max_bits))
    out, t_dec = timed(lambda: dequantize(data).values)
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
    dtype = cap.meta["dtype"]
    for kind, tensors in (("key", cap.keys), ("value", cap.values)):
        for t in tensors:
            data, seconds = timed(lambda t=t, kind=kind: codec.encode(to_block(t, dtype, kind)))
            t_enc += seconds
            back, seconds = timed(lambda data=data: to_tensor(codec.decode(data)))
            out.setdefault(kind, []).append(back)
            t_dec += seconds
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
    head = [
        "codec", "bits/pos tokens", "bits/pos residual", "bits/pos total", "rel. L2 error",
        "max abs error", "encode s", "decode s",
    ]  # fmt: skip
    cells = [
        [r["codec"], f"{r['token_bits_per_position']:.2f}",
         f"{r['residual_bits_per_position']:,.1f}", f"{r['bits_per_position']:,.1f}",
         f"{r['rel_l2_error']:.4f}", f"{r['max_abs_error']:.4f}", f"{r['encode_s']:.1f}",
         f"{r['decode_s']:.1f}"]
        for r in rows
    ]  # fmt: skip
    return "\n".join(table(head, cells))


def main(argv: list[str] | None = None) -> dict:
    from seqkv_cli import capture
    from seqkv_cli.kvcapture.engine import canonical_model
    from seqkv_cli.runtime.numerics import LEGACY

    parser = harness.parser(__doc__, threads=1)
    parser.add_argument("--tokens", type=int, default=256, help="positions of prose.txt to use")
    args = parser.parse_args(argv)
    lm = harness.start(args)
    canon = canonical_model(lm, LEGACY)  # delta-topk's what-if forward is the legacy one's
    with tempfile.TemporaryDirectory() as tmp:
        [res] = capture(
            [str(SAMPLE / "prose.txt")],
            model=lm,
            out=Path(tmp),
            max_tokens=args.tokens,
            numerics=LEGACY,
        )
    cap = res.capture
    rows = [run_session_codec(c, cap, canon) for c in CONFIGS]
    rows += [run_no_predictor(cap, b, canon.vocab_size) for b in (2, 4, 8)]
    rows += [run_pervector(cap, c) for c in ("kivi2", "turbo3")]
    return harness.finish(
        args, lm, report, positions=cap.positions, log2_ppl=cap.log2_ppl, rows=rows
    )


def report(result: dict) -> str:
    title = "delta-topk (paper's Layer 2) vs seq and per-vector codecs"
    rows = result["rows"]
    notes = [f"- {r['codec']}: {note}" for r in rows for note in r["notes"]]
    return "\n".join(
        [
            *harness.heading(title, result),
            f"K/V of {result['positions']} positions of sample_data/prose.txt, bf16 "
            f"(log2 PP {result['log2_ppl']:.2f} bits).",
            "",
            markdown(rows),
            "",
            *notes,
            "",
        ]
    )


if __name__ == "__main__":
    main()
