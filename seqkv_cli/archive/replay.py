"""Replay: a user's cache brought back by re-running the user's own model the same way.

No residual against seqkv's canonical forward can be small for a cache computed in other
numerics (a bf16 GPU cache differs from an fp32 recompute in most elements). What makes such
a cache cheap is that it was *computed*: the same model, dtype, attention implementation,
device and libraries, called on the same tokens with the same schedule (one prefill of p
tokens, then single steps, as `generate` does), give the same bits. A replay record says how
the cache was produced and holds a SHA-256 of every K/V tensor; `load` re-runs the schedule
and accepts the result only if the digest matches, so a machine or library that does not
reproduce it is told so in one line instead of getting a silently different cache.

The record lives in the session's metadata in the archive: as JSON in files before format
1.9, in binary in a 1.9 file's segment table (trie/replay_records.py: what the record before
it does not already say, and the digest's first 16 bytes). The archive's own K/V for the
session stay the canonical recompute, so any seqkv restores an approximation of the cache
portably, and `load(..., replay=False)` gives that.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch

from seqkv_cli.errors import SeqkvError
from seqkv_cli.kvcapture.caches import cache_layers
from seqkv_cli.kvcapture.capture_file import DTYPES
from seqkv_cli.runtime.hfcompat import cache_kwarg
from seqkv_cli.trie import DIGEST_BYTES, MAX_RUNS

RECORD_VERSION = 1


@dataclass(frozen=True)
class Schedule:
    """The forward calls that filled the cache, as token counts in order: `generate` on a
    prompt of p tokens is (p, 1, 1, ...); continuing a loaded cache appends (q, 1, 1, ...)."""

    calls: tuple[int, ...]

    @classmethod
    def for_tokens(
        cls, n: int, prompt_length: int | None = None, schedule: list[int] | None = None
    ) -> Schedule:
        if prompt_length is not None and schedule is not None:
            raise SeqkvError("give prompt_length or schedule, not both")
        if schedule is not None:
            calls = list(schedule)
            if not calls or any(
                isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in calls
            ):
                raise SeqkvError(
                    "schedule must be a list of positive token counts, one per forward"
                )
            if sum(calls) != n:
                raise SeqkvError(f"schedule covers {sum(calls)} tokens; the session has {n}")
            return cls(tuple(calls))
        if prompt_length is None:
            return cls((n,))
        if isinstance(prompt_length, bool) or not isinstance(prompt_length, int):
            raise SeqkvError(f"prompt_length must be an int, not {prompt_length!r}")
        if not 1 <= prompt_length <= n:
            raise SeqkvError(
                f"prompt_length must be in 1..{n} (the tokens added), not {prompt_length}"
            )
        return cls((prompt_length,) + (1,) * (n - prompt_length))

    def runs(self) -> list[list[int]]:
        """Run-length form for the record: [[tokens per call, calls], ...]."""
        out: list[list[int]] = []
        for c in self.calls:
            if out and out[-1][0] == c:
                out[-1][1] += 1
            else:
                out.append([c, 1])
        return out

    @classmethod
    def from_runs(cls, runs: list) -> Schedule:
        calls: list[int] = []
        for length, count in runs:
            calls.extend([length] * count)
        return cls(tuple(calls))


def cache_digest(keys: list[torch.Tensor], values: list[torch.Tensor]) -> str:
    """SHA-256 over every layer's K then V, as stored (dtype, shape and bytes)."""
    h = hashlib.sha256()
    for k, v in zip(keys, values, strict=True):
        for t in (k, v):
            t = t.detach().to("cpu").contiguous()
            h.update(f"{t.dtype}:{tuple(t.shape)}\n".encode())
            h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def environment_of(model: torch.nn.Module) -> dict:
    import transformers

    param = next(model.parameters())
    return {
        "model_dtype": str(param.dtype).removeprefix("torch."),
        "device": param.device.type,
        "attention": str(getattr(model.config, "_attn_implementation", None)),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def make_record(model: torch.nn.Module, schedule: Schedule, dtype_name: str, digest: str) -> dict:
    return {
        "version": RECORD_VERSION,
        "calls": schedule.runs(),
        "cache_dtype": dtype_name,
        "sha256": digest,
        **environment_of(model),
    }


def read_record(meta: dict, positions: int) -> dict | None:
    """The session's replay record, checked (its calls must cover exactly the session's
    `positions`, so a crafted record cannot ask for more work than the session has); None
    when it has none."""
    raw = meta.get("replay")
    if raw is None:
        return None
    try:
        rec = json.loads(raw) if isinstance(raw, str) else raw
        if not isinstance(rec, dict):
            raise TypeError("not an object")
        runs = rec.get("calls")
        ok = (
            rec.get("version") == RECORD_VERSION
            and isinstance(runs, list)
            and 0 < len(runs) <= MAX_RUNS
            and all(
                isinstance(r, list)
                and len(r) == 2
                and all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in r)
                for r in runs
            )
            and isinstance(rec.get("sha256"), str)
            and len(rec["sha256"]) in (2 * DIGEST_BYTES, 64)  # binary records keep 16 bytes
            and all(c in "0123456789abcdef" for c in rec["sha256"])
            and rec.get("cache_dtype") in ("bf16", "fp16", "fp32")
            and sum(length * count for length, count in runs) == positions
        )
    except (TypeError, ValueError, AttributeError, RecursionError):
        ok = False
    if not ok:
        raise SeqkvError(f"session {meta.get('session_id', '?')!r}: its replay record is malformed")
    return rec


def replay(model: torch.nn.Module, token_ids: list[int], rec: dict) -> tuple[list, list]:
    """Re-run `model` on the tokens with the recorded schedule; K/V per layer on the CPU,
    (kv_heads, n, head_dim), in the recorded cache dtype."""
    from transformers import DynamicCache

    n = len(token_ids)
    covered = sum(length * count for length, count in rec["calls"])
    if covered != n:
        raise SeqkvError(
            f"the replay record's schedule covers {covered} tokens; the session has {n}"
        )
    calls = Schedule.from_runs(rec["calls"]).calls
    import inspect

    device = next(model.parameters()).device
    ids = torch.tensor([token_ids], dtype=torch.long, device=device)
    cache = DynamicCache(config=model.config)
    kwargs = {cache_kwarg(type(model).forward): cache, "use_cache": True}
    if "logits_to_keep" in inspect.signature(type(model).forward).parameters:
        kwargs["logits_to_keep"] = 1  # only K/V are wanted: no (n x vocab) logits
    try:
        with torch.inference_mode():
            start = 0
            for length in calls:
                model(ids[:, start : start + length], **kwargs)
                start += length
    except (RuntimeError, ValueError, TypeError) as exc:  # OOM, a model that refuses the call
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SeqkvError(f"replay could not run the model: {first[:200]}") from None
    dtype = DTYPES[rec["cache_dtype"]]
    pairs = cache_layers(cache)
    keys = [k[0].detach().to("cpu", dtype).contiguous() for k, _ in pairs]
    values = [v[0].detach().to("cpu", dtype).contiguous() for _, v in pairs]
    return keys, values


def reproduced(model: torch.nn.Module, token_ids: list[int], rec: dict) -> tuple[list, list] | None:
    """The replayed K/V when their digest is the recorded one (all of it, or the first 16
    bytes that a binary record keeps), else None."""
    keys, values = replay(model, token_ids, rec)
    return (keys, values) if cache_digest(keys, values).startswith(rec["sha256"]) else None


def not_reproduced_message(
    session_id: str, rec: dict, model: torch.nn.Module, worst: float | None
) -> str:
    here = environment_of(model)
    differs = [f"{k} {rec.get(k)} -> {here[k]}" for k in here if str(rec.get(k)) != str(here[k])]
    why = "; ".join(differs) if differs else "same software and device: another machine class"
    distance = f" (max difference {worst:.3g} from the canonical K/V)" if worst is not None else ""
    return (
        f"session {session_id!r}: its cache is not reproduced here by replay{distance}: {why}; "
        "load(..., replay=False) gives the canonical K/V, or add it again with "
        "residual='lossless' for a copy that restores anywhere"
    )


def entry_record(entry: dict) -> dict | None:
    """The replay record an archive's index entry holds, checked; None for a session without
    one (a record is read against the entry's own session id and length)."""
    meta = {**entry.get("capture_meta", {}), "session_id": entry["id"]}
    return read_record(meta, int(entry["positions"]))


def replay_schedule(entry: dict) -> list[int] | None:
    """The forward calls (token counts) that filled a replayed session's cache; None for a
    session without a replay record."""
    rec = entry_record(entry)
    return None if rec is None else list(Schedule.from_runs(rec["calls"]).calls)


def session_kv(path, lm, runner, session_id: str, use_replay: bool = True):
    """A stored session's K/V (per layer, on the CPU), its positions and the calls that filled
    them: (keys, values, positions, calls), calls None where not replayed. A replayed session
    re-runs `runner()` (the user's model) under its record and must reproduce the digest, else
    one line says what differs; its tokens are read without seqkv's model where its nodes are
    `seq-fast` (the replay is the load). `use_replay=False`: the canonical K/V."""
    from seqkv_cli.archive.restore import Archive

    with Archive(path, model=lm) as arc:
        entry = arc.session(str(session_id))
        rec = entry_record(entry) if use_replay else None
        ids = None if rec is None else arc.known_tokens(entry, lm.vocab_size)
        if ids is None:
            cap = arc.restore(entry)
            keys, values, tokens = cap.keys, cap.values, cap.tokens.tolist()
        else:
            tokens = ids.tolist()
    if rec is None:
        return keys, values, len(tokens), None
    model = runner()
    got = reproduced(model, tokens, rec)
    if got is None:
        raise SeqkvError(not_reproduced_message(session_id, rec, model, None))
    return got[0], got[1], len(tokens), rec["calls"]
