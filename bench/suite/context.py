"""Scaling with context length: bits/position and encode/decode time, 256 -> 4,096 tokens.

One long plain-text document (prose, then code, then the agent transcript) is captured once
at the longest length and cut at each shorter one (exact for canonical captures). `seq`
decode is run once, on the longest: the decoder reaches position L after L - 1 model steps,
whatever comes after, so the time at which it got there is the decode time of L tokens.
"""

from __future__ import annotations

import time
from pathlib import Path

from bench.suite.common import Run, compress, restore

CONTEXT_FULL = (256, 512, 1024, 2048, 4096)
CONTEXT_QUICK = (32, 64)


class _Clock:
    """The canonical model, recording (time, tokens fed so far) after every forward call."""

    def __init__(self, canon) -> None:
        self._canon, self.fed = canon, []

    def __getattr__(self, name: str):
        return getattr(self._canon, name)

    def _stamp(self, tokens: int) -> None:
        total = (self.fed[-1][1] if self.fed else 0) + tokens
        self.fed.append((time.perf_counter(), total))

    def forward(self, state, token_ids):
        out = self._canon.forward(state, token_ids)
        self._stamp(int(token_ids.shape[0]))
        return out

    def forward_rows(self, states, token_ids):
        out = self._canon.forward_rows(states, token_ids)
        self._stamp(1)  # one decode step (this section decodes one session)
        return out


def _seq_decode_clocked(run: Run, skv: Path) -> tuple[object, float, list]:
    """Restore a one-session seq archive; also return (seconds, tokens fed) after each call.

    The clock goes where `Archive.canonical()` finds the model's canonical forward (the
    LoadedModel's cache), so the decode is the library's own, timed from outside.
    """
    from seqkv_cli.archive import Archive
    from seqkv_cli.kvcapture.engine import canonical_model

    real = canonical_model(run.lm)
    clock = _Clock(real)
    run.lm.extra["canonical"] = clock
    try:
        with Archive(skv, model=run.lm) as arc:
            start = time.perf_counter()
            [(_, restored)] = list(arc.restore_many(arc.sessions))
            total = time.perf_counter() - start
    finally:
        run.lm.extra["canonical"] = real
    if isinstance(restored, Exception):
        raise SystemExit(f"context: {restored}")
    return restored, total, [(t - start, fed) for t, fed in clock.fed]


def run_context(run: Run) -> dict:
    """One long document (prose, code, agent chat) cut at each length; seq and seq-fast."""
    from bench.suite.inputs import capture_ids, long_token_ids, save, slice_capture
    from seqkv_cli.archive import same_capture

    lengths = CONTEXT_QUICK if run.quick else CONTEXT_FULL
    run.log(f"context: capturing {lengths[-1]:,} tokens of one long document")
    full = capture_ids(run, long_token_ids(run.lm, lengths[-1]), f"long-{lengths[-1]}")
    folder, rows, prev = run.scratch("context"), [], 0
    for n in lengths:
        path = save(slice_capture(full, n, f"long-{n}"), folder)
        marginal = float(full.surprisal[max(prev - 1, 0) : n - 1].double().mean())
        for codec in ("seq", "seq-fast"):
            run.log(f"context: {codec} at {n:,} tokens")
            res, t_enc = compress(run, [path], folder / f"{codec}-{n}.skv", codec)
            row = {
                "codec": codec,
                "positions": n,
                "log2_ppl": float(full.surprisal[: n - 1].double().mean()),
                "marginal_log2_ppl": marginal,
                "bits_per_position": res.file_bytes * 8 / n,
                "token_bits_per_position": res.part_bytes.get("tokens", 0) * 8 / n,
                "encode_s": t_enc,
            }
            if codec == "seq-fast":
                row["decode_s"] = restore(run, folder / f"{codec}-{n}.skv", [f"long-{n}"])[1]
            rows.append(row)
        prev = n
    run.log(f"context: seq decode of {lengths[-1]:,} tokens (times read at every length)")
    restored, total, fed = _seq_decode_clocked(run, folder / f"seq-{lengths[-1]}.skv")
    if not same_capture(full, restored):
        raise SystemExit("context: the seq decode did not restore the capture bit-exactly")
    for row in rows:
        if row["codec"] == "seq":
            n = row["positions"]
            # position n is known once n - 1 tokens have been fed (the first needs no step)
            at = next((t for t, count in fed if count >= n - 1), total)
            row["decode_s"] = total if n == lengths[-1] else at
            row["decode_timing"] = "full restore" if n == lengths[-1] else "read off the longest"
    return {"lengths": list(lengths), "rows": rows}
