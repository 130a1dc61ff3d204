"""Speed ratios against plain transformers, and the entropy coder against zstd.

* the `seq` token decoder vs a plain transformers DynamicCache step loop (one token per
  forward): one session, and 8 sessions stepped as rows of one pass;
* `seq-fast` decode of a session vs one plain transformers prefill of the same tokens;
* the rANS entropy coder (numpy and torch-CPU backends) vs zstd -3 / -19, on byte planes of
  real bf16 K/V, one thread.

The measurements are the functions of bench/studies/seq.py and bench/studies/entropy.py.
"""

from __future__ import annotations

import torch

from bench.suite.common import Run

ROWS = 8


def run_speed(run: Run, set_results: list) -> dict:
    from bench.studies.entropy import run as entropy_run
    from bench.studies.seq import (
        decode_speed,
        hf_prefill_seconds,
        hf_step_loop,
        seq_fast_decode_seconds,
    )
    from bench.suite.inputs import save, slice_capture

    caps = [r.capture for r in set_results]
    ids = torch.cat([c.tokens for c in caps])
    steps = 16 if run.quick else 128
    if len(ids) < ROWS * steps:
        raise SystemExit(f"the set has {len(ids)} tokens, fewer than {ROWS} x {steps}")
    run.log(f"speed: transformers step loop, {steps} tokens")
    step_tps = hf_step_loop(run.lm, ids[:steps])
    run.log(f"speed: seq decode, 1 session and {ROWS} sessions as rows, {steps} tokens each")
    one = decode_speed(run.lm, ids, 1, steps)
    rows = decode_speed(run.lm, ids, ROWS, steps)
    longest = max(caps, key=lambda c: c.positions)
    n = min(longest.positions, 1024)
    run.log(f"speed: seq-fast decode vs one transformers prefill, {n} tokens")
    prefill_s = hf_prefill_seconds(run.lm, longest.tokens[:n])
    path = save(slice_capture(longest, n, f"{longest.session_id}-{n}"), run.scratch("speed"))
    fast_s = seq_fast_decode_seconds(run.lm, path, run.scratch("speed"))
    size_mb = 0.25 if run.quick else 4.0
    run.log(f"speed: entropy coder vs zstd, {size_mb:g} MiB per byte plane of real bf16 K/V")
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the entropy figures are per core
    try:
        entropy = entropy_run(size_mb, 1 if run.quick else 2, str(set_results[0].path))
    finally:
        torch.set_num_threads(torch_threads)
    return {
        "tokens_per_measurement": steps,
        "hf_step_loop_tokens_per_s": step_tps,
        "seq_decode_tokens_per_s_1_session": one,
        f"seq_decode_tokens_per_s_{ROWS}_sessions": rows,
        "seq_decode_vs_step_loop_1_session": one / step_tps,
        f"seq_decode_vs_step_loop_{ROWS}_sessions": rows / step_tps,
        "prefill_tokens": n,
        "hf_prefill_s": prefill_s,
        "seq_fast_decode_s": fast_s,
        "seq_fast_decode_vs_prefill": fast_s / prefill_s,
        "entropy_size_mib": size_mb,
        "entropy": entropy,
    }
