"""Sequential codecs on the embedded model: rate vs log2 PP, exactness, and speed ratios.

Usage (the command recorded in docs/BENCHMARKS.md):
    python -m bench.studies.seq --append docs/BENCHMARKS_LOG.md --json bench/results/seq.json

Measures, in one run on one machine:
* every sample_data text of >= 1,000 tokens, canonical bf16 capture: `seq` compress ->
  decompress bit-exact? residual bytes, bits/position vs 1.02 x log2 PP + header bits;
* a non-canonical (ordinary transformers fp32) capture: `seq` with a lossless residual;
* speed: `seq` encode and decode tokens/s (1 session, and sessions batched as rows) against a
  plain transformers DynamicCache step loop; `seq-fast` decode of 1,024 tokens against one
  plain transformers prefill.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from bench import harness
from bench.harness import SAMPLE, timed
from bench.table import table

TEXTS = ["prose.txt", "sample_code.py", "agent_transcript.jsonl"]


def hf_step_loop(lm, ids: torch.Tensor) -> float:
    """Tokens/s of a plain transformers loop: one token per forward, DynamicCache."""
    from transformers import DynamicCache

    from seqkv_cli.runtime.hfcompat import forward_with_cache

    def loop():
        cache = DynamicCache()
        for i in range(len(ids)):
            _, cache = forward_with_cache(lm.model, ids[None, i : i + 1], cache)

    with torch.inference_mode():
        _, seconds = timed(loop)
    return len(ids) / seconds


def hf_prefill_seconds(lm, ids: torch.Tensor) -> float:
    with torch.inference_mode():
        lm.model(ids[None])  # warm-up
        return harness.best_of(lambda: lm.model(ids[None]), 2)[1]


def rate_and_exactness(lm, caps, folder: Path) -> list[dict]:
    from seqkv_cli.archive import Archive, compress_captures, same_capture
    from seqkv_codecs.sequential import read_token_stream_info

    skv = folder / "seq.skv"
    res, t_enc = timed(
        lambda: compress_captures(
            [c.path for c in caps], skv, codec="seq", model=lm, check=False, layout="flat"
        )
    )
    rows = []
    with Archive(skv, model=lm) as arc:
        header_bytes = arc.reader.size - sum(e.length for e in arc.reader.sections)
        restored, t_dec = timed(lambda: list(arc.restore_many(arc.sessions)))
        sizes = {e.name: e.length for e in arc.reader.sections}
        for (entry, back), cap in zip(restored, caps, strict=True):
            n = cap.capture.positions
            stream = arc.reader.read_section(f"s{entry['index']}/tokens.seq")
            info = read_token_stream_info(stream)
            token_b = info.payload_bytes  # the stream's own framing is counted as header
            residual_b = sum(
                v for k, v in sizes.items() if k.startswith(f"s{entry['index']}/residual.")
            )
            # container header + index split by positions, plus the token stream's framing
            share = header_bytes * n / res.positions + info.overhead_bytes
            log2_ppl = cap.capture.log2_ppl
            bits = (token_b + residual_b) * 8 / n
            rows.append(
                {
                    "session": entry["id"],
                    "numeric_path": entry["numeric_path"],
                    "positions": n,
                    "log2_ppl": log2_ppl,
                    "token_bits_per_position": token_b * 8 / n,
                    "residual_bits_per_position": residual_b * 8 / n,
                    "header_bits_per_position": share * 8 / n,
                    "total_bits_per_position": bits + share * 8 / n,
                    "bound": 1.02 * log2_ppl + share * 8 / n,
                    "within_bound": bits + share * 8 / n <= 1.02 * log2_ppl + share * 8 / n,
                    "exact": not isinstance(back, Exception) and same_capture(cap.capture, back),
                }
            )
    total = sum(c.capture.positions for c in caps)
    speed = {
        "encode_tokens_per_s": total / t_enc,
        "decode_tokens_per_s_batched": total / t_dec,
        "sessions_in_batch": len(caps),
    }
    return rows, speed


def decode_speed(lm, ids, sessions: int, length: int, numerics: str | None = None) -> float:
    """seq decode tokens/s with `sessions` independent sessions stepped as rows."""
    from seqkv_cli.kvcapture.engine import canonical_model
    from seqkv_cli.sequential.adapter import CanonicalLogits
    from seqkv_codecs.sequential import encode_tokens
    from seqkv_codecs.sequential.batch_decode import decode_tokens_batch

    canon = canonical_model(lm, numerics)
    seqs = [ids[i * length : (i + 1) * length].numpy() for i in range(sessions)]
    streams = [encode_tokens(s, CanonicalLogits(canon)) for s in seqs]
    out, seconds = timed(lambda: decode_tokens_batch(streams, CanonicalLogits(canon)))
    assert all((a == b).all() for a, b in zip(out, seqs, strict=True))
    return sessions * (length - 1) / seconds


def seq_fast_decode_seconds(lm, cap_path: Path, folder: Path) -> float:
    from seqkv_cli.archive import Archive, compress_captures

    compress_captures([cap_path], folder / "fast.skv", codec="seq-fast", model=lm, check=False)
    with Archive(folder / "fast.skv", model=lm) as arc:
        arc.canonical()
        return harness.best_of(lambda: arc.restore(arc.sessions[0]), 2)[1]


def main(argv: list[str] | None = None) -> dict:
    parser = harness.parser(__doc__)
    args = parser.parse_args(argv)
    from seqkv_cli import capture
    from seqkv_cli.kvcapture.capture_file import save_capture

    lm = harness.start(args)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        caps = capture([str(SAMPLE / t) for t in TEXTS], model=lm, out=folder / "canon")
        [plain] = capture(
            [str(SAMPLE / "prose.txt")],
            model=lm,
            out=folder / "plain",
            canonical=False,
        )
        plain.capture.meta["session_id"] = "prose (non-canonical)"
        save_capture(plain.capture, plain.path)
        caps.append(plain)
        rows, seq_speed = rate_and_exactness(lm, caps, folder)
        ids = caps[0].capture.tokens
        step_tps = hf_step_loop(lm, ids[:128])
        one = decode_speed(lm, ids, 1, 128)
        eight = decode_speed(lm, torch.cat([c.capture.tokens for c in caps[:3]]), 8, 128)
        prefill_s = hf_prefill_seconds(lm, caps[1].capture.tokens[:1024])
        [cap1024] = capture(
            [str(SAMPLE / "sample_code.py")],
            model=lm,
            out=folder / "c1024",
            max_tokens=1024,
        )
        fast_s = seq_fast_decode_seconds(lm, cap1024.path, folder)
    speed = {
        "hf_step_loop_tokens_per_s": step_tps,
        "seq_decode_tokens_per_s_1_session": one,
        "seq_decode_tokens_per_s_8_sessions": eight,
        **{f"seq_{k}": v for k, v in seq_speed.items()},
        "hf_prefill_1024_s": prefill_s,
        "seq_fast_decode_1024_s": fast_s,
    }
    return harness.finish(args, lm, markdown, rows=rows, speed=speed)


def markdown(result: dict) -> str:
    rows, speed = result["rows"], result["speed"]
    step_tps = speed["hf_step_loop_tokens_per_s"]
    one, eight = (speed[f"seq_decode_tokens_per_s_{k}"] for k in ("1_session", "8_sessions"))
    lines = [
        *harness.heading("Sequential codecs (`seq`, `seq-fast`)", result),
    ]
    head = [
        "session", "numeric path", "positions", "log2 PP", "tokens b/pos", "residual b/pos",
        "header b/pos", "total b/pos", "bound 1.02·log2PP+hdr", "within", "bit-exact",
    ]  # fmt: skip
    cells = [
        [r["session"], r["numeric_path"], f"{r['positions']:,}", f"{r['log2_ppl']:.3f}",
         f"{r['token_bits_per_position']:.3f}", f"{r['residual_bits_per_position']:.1f}",
         f"{r['header_bits_per_position']:.3f}", f"{r['total_bits_per_position']:.3f}",
         f"{r['bound']:.3f}", "yes" if r["within_bound"] else "NO", "yes" if r["exact"] else "NO"]
        for r in rows
    ]  # fmt: skip
    lines += table(head, cells)
    lines += ["", *table(["speed", "value"], [[k, f"{v:,.2f}"] for k, v in speed.items()])]
    lines += [
        "",
        f"Ratios: seq decode vs transformers step loop: {one / step_tps:.2f}x "
        f"(1 session), {eight / step_tps:.2f}x (8 sessions as rows); seq encode vs step "
        f"loop: {speed['seq_encode_tokens_per_s'] / step_tps:.2f}x; seq-fast decode of 1,024 "
        f"tokens / one transformers prefill: "
        f"{speed['seq_fast_decode_1024_s'] / speed['hf_prefill_1024_s']:.2f}x.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
