"""Every codec through the real container path: rate, fidelity and encode/decode speed.

Each codec compresses the fixed set into one `.skv` with `compress_captures` (check off: the
decode is timed separately) and restores it with `Archive.restore_many`, so the numbers are
what a user of `seqkv compress` / `decompress` gets, container headers included.
"""

from __future__ import annotations

from pathlib import Path

from bench.suite.common import Run, compress, fp16_bits_per_position, restore
from bench.suite.fidelity import kv_errors, perplexity_change
from bench.suite.inputs import log2_ppl

PERVECTOR = ("raw", "lossless", "int8", "kivi4", "kivi2", "turbo4", "turbo3")
# lossless and kivi cost ~0.2 s per K/V block whatever its size (per-stream rANS loops):
# ~50 s each for the quick set's 240 blocks, so the smoke test keeps to the fast ones
PERVECTOR_QUICK = ("raw", "int8", "turbo3")
SESSION = ("seq", "seq-fast")
DELTA_TOPK = {"id": "delta-topk", "variant": "topk", "k": 20, "max_bits": 4}


def codec_name(codec: str | dict) -> str:
    if isinstance(codec, str):
        return codec
    return codec["id"] + "".join(f" {k}={v}" for k, v in codec.items() if k != "id")


def measure(run: Run, codec: str | dict, caps: list, paths: list[Path], note: str = "") -> dict:
    """Compress `paths` with `codec`, restore every session, compare with `caps`."""
    from seqkv_cli.archive import Archive, account

    name = codec_name(codec)
    run.log(f"rates: {name} on {sum(c.positions for c in caps):,} positions {note}".rstrip())
    out = run.scratch("rates") / (name.replace(" ", "_").replace("=", "") + ".skv")
    res, t_enc = compress(run, paths, out, codec)
    results, t_dec = restore(run, out, [c.session_id for c in caps])
    with Archive(out, model=run.lm) as arc:
        per_session = [
            {k: s[k] for k in ("id", "positions", "log2_ppl", "bits_per_position", "breakdown")}
            for s in account(arc).sessions
        ]
    n, kv_mb = res.positions, res.input_kv_bytes / 1e6
    fp16_bytes = fp16_bits_per_position(run.lm) * n / 8
    row = {
        "codec": name,
        "note": note,
        "sessions": res.sessions,
        "positions": n,
        "log2_ppl": log2_ppl(caps),
        "file_bytes": res.file_bytes,
        "part_bytes": res.part_bytes,
        "bits_per_position": res.file_bytes * 8 / n,
        "ratio_vs_fp16": fp16_bytes / res.file_bytes,
        "encode_s": t_enc,
        "decode_s": t_dec,
        "encode_tokens_per_s": n / t_enc,
        "decode_tokens_per_s": n / t_dec,
        "encode_kv_MBps": kv_mb / t_enc,
        "decode_kv_MBps": kv_mb / t_dec,
        "per_session": per_session,
        **kv_errors(caps, results),
    }
    if not row["bit_exact"]:
        run.log(f"rates: {name}: perplexity change of continuations")
        row.update(perplexity_change(run.lm, caps, results))
    return row


def run_rates(run: Run, set_results: list) -> dict:
    """Every per-vector and session codec on the set; delta-topk and a non-canonical capture
    on a prose slice (their decode is too slow for the whole set)."""
    from bench.suite.inputs import capture_ids, save, slice_capture

    caps = [r.capture for r in set_results]
    paths = [r.path for r in set_results]
    codecs = (*(PERVECTOR_QUICK if run.quick else PERVECTOR), *SESSION)
    rows = [measure(run, c, caps, paths) for c in codecs]
    prose = caps[0]
    n = min(prose.positions, 16 if run.quick else 128)
    folder = run.scratch("slices")
    head = slice_capture(prose, n, f"prose-{n}")
    note = f"(first {n} positions of prose)"
    rows.append(measure(run, DELTA_TOPK, [head], [save(head, folder)], note))
    plain = capture_ids(run, head.tokens.tolist(), f"prose-{n}-noncanonical", canonical=False)
    note = f"(first {n} positions of prose, ordinary fp32 capture: lossless residual)"
    rows.append(measure(run, "seq", [plain], [save(plain, folder)], note))
    return {"positions": sum(c.positions for c in caps), "log2_ppl": log2_ppl(caps), "rows": rows}
