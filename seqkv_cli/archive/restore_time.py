"""How long an archive takes to restore on this machine, estimated without restoring it.

A codec that steps the model (`seq`, `delta-topk`) restores at one model pass per token; its
restore time is the number of passes the decoder needs times the time of one pass with that
many rows side by side, both found here: passes from the archive's shape (sessions as rows of
one pass, trie nodes starting at their branch points: trie.schedule.planned_passes), the pass
time measured on this machine's canonical forward at the archive's typical context. A codec
that prefills (`seq-fast`) costs its tokens at the measured prefill rate; per-vector codecs
are timed on one real session and scaled by positions. Guesses (draft-and-verify) can only
shorten a `seq` restore; the estimate counts none.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from seqkv_cli.archive.restore import SESSION_BATCH
from seqkv_cli.sequential.registry import capabilities
from seqkv_codecs.sequential.parallel_stream import chunk_bounds

if TYPE_CHECKING:
    from seqkv_cli.archive.restore import Archive
    from seqkv_cli.runtime.forward import CanonicalForward

CALIBRATION_REPEATS = 3  # passes timed per row count (the fastest is kept: noise only adds)
MAX_CALIBRATION_CONTEXT = 512  # attention's share of a pass is small below this on every model


@dataclass
class RestoreEstimate:
    seconds: float  # the whole archive, sessions decoded together as restore_many does
    tokens: int  # positions the decoder produces (shared prefixes once)
    per_session: dict[str, float] = field(default_factory=dict)  # each session alone
    basis: str = ""  # what was measured, in words

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


def estimate_restore(arc: Archive) -> RestoreEstimate:
    """Estimate `arc` (an open archive.restore.Archive; its model loads if it needs one)."""
    caps = capabilities(arc.codec)
    if not caps.needs_canonical:
        return _pervector(arc)
    canon = arc.canonical()
    positions = [e["positions"] for e in arc.sessions]
    context = max(1, min(MAX_CALIBRATION_CONTEXT, sum(positions) // max(2 * len(positions), 1)))
    passes, tokens, rows = _passes(arc)
    if not caps.steps_model:  # seq-fast: one prefill per node
        rate = _prefill_seconds_per_token(canon, context)
        per = {e["id"]: e["positions"] * rate for e in arc.sessions}
        basis = f"prefill {1 / rate:,.0f} tokens/s here (context {context})"
        return RestoreEstimate(tokens * rate, tokens, per, basis)
    runs = getattr(arc.codec, "parallel", 1)  # seq --parallel: runs side by side, a prefill
    run_context = max(1, context // runs)
    one = _pass_seconds(canon, run_context, 1)
    many = _pass_seconds(canon, run_context, rows) if rows > 1 else one
    extra = _prediction_seconds_per_token(arc, canon, context)  # delta-topk's K rows
    if runs > 1:  # each session alone: its runs as rows, then its prefill
        extra += _prefill_seconds_per_token(canon, context)
        alone = many if rows == runs else _pass_seconds(canon, run_context, runs)
        per = {
            e["id"]: chunk_bounds(e["positions"], runs)[0][1] * alone + e["positions"] * extra
            for e in arc.sessions
        }
    else:
        per = {e["id"]: e["positions"] * (one + extra) for e in arc.sessions}
    basis = f"one pass {one * 1000:,.0f} ms with 1 row"
    if rows > 1:
        basis += f", {many * 1000:,.0f} ms with {rows} rows"
    basis += (
        f" (context {run_context}); {passes:,} passes, no guesses counted (they only save passes)"
    )
    if runs > 1:
        basis += f"; {runs} runs a session, then its prefill ({extra * 1000:,.1f} ms a token)"
    return RestoreEstimate(passes * many + tokens * extra, tokens, per, basis)


def _passes(arc) -> tuple[int, int, int]:
    """(model passes, tokens decoded, rows of a typical pass) for restoring every session."""
    if arc.trie is not None:
        from seqkv_cli.trie import planned_passes

        passes, tokens = planned_passes(arc.trie, list(range(len(arc.sessions))))
    else:  # flat archives: sessions in batches, each batch as long as its longest run
        runs = getattr(arc.codec, "parallel", 1)
        lengths = [e["positions"] for e in arc.sessions]
        batches = [lengths[i : i + SESSION_BATCH] for i in range(0, len(lengths), SESSION_BATCH)]
        passes = sum(max(chunk_bounds(n, runs)[0][1] for n in b) for b in batches)
        tokens = sum(lengths)
    return passes, tokens, max(1, round(tokens / max(passes, 1)))


def _ids(canon: CanonicalForward, n: int) -> torch.Tensor:
    """Token ids to time with: any ids cost the same; these spread over the vocabulary."""
    return (torch.arange(n, dtype=torch.long) * 7919 + 13) % canon.vocab_size


def _pass_seconds(canon: CanonicalForward, context: int, rows: int) -> float:
    """The fastest of a few passes of `rows` single-token rows, each after `context` tokens."""
    state = canon.new_state(context + CALIBRATION_REPEATS + 1)
    canon.forward(state, _ids(canon, context))
    states = [state.fork(context, context + CALIBRATION_REPEATS + 1) for _ in range(rows)]
    best = float("inf")
    for k in range(CALIBRATION_REPEATS):
        ids = [int(x) for x in _ids(canon, rows + k)[k:]]
        start = time.perf_counter()
        canon.forward_rows(states, ids)
        best = min(best, time.perf_counter() - start)
    return best


def _prefill_seconds_per_token(canon: CanonicalForward, context: int) -> float:
    best = float("inf")
    for _ in range(2):
        state = canon.new_state(context)
        start = time.perf_counter()
        canon.forward(state, _ids(canon, context))
        best = min(best, (time.perf_counter() - start) / context)
    return best


def _prediction_seconds_per_token(arc, canon: CanonicalForward, context: int) -> float:
    """delta-topk's restore also runs k rows per position for its prediction: ~k prefills."""
    k = getattr(arc.codec, "k", None)
    if k is None:
        return 0.0
    rows = 1 if getattr(arc.codec, "variant", "topk") == "linear" else int(k)
    return rows * _prefill_seconds_per_token(canon, context)


def _pervector(arc) -> RestoreEstimate:
    """Time the restore of the shortest session and scale by positions."""
    entry = min(arc.sessions, key=lambda e: e["positions"])
    start = time.perf_counter()
    arc.restore(entry)
    per_position = (time.perf_counter() - start) / max(entry["positions"], 1)
    per = {e["id"]: e["positions"] * per_position for e in arc.sessions}
    tokens = sum(e["positions"] for e in arc.sessions)
    basis = f"session {entry['id']} restored here at {1 / max(per_position, 1e-12):,.0f} tokens/s"
    return RestoreEstimate(tokens * per_position, tokens, per, basis)
