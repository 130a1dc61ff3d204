"""What the library API is given, checked before any model work, and one session of `add` made
ready to write.

Session ids, token ids and a session's length against the model context are shared by
`open_archive(...).add`/`add_many` and `compress_sessions`. A session's user metadata
(`add(meta=...)`) is refused at the door unless the archive can hold it and read it back: the
bounds are the trie reader's own (a segment's session names and profiles are refused when
they nest deeper than `trie.MAX_JSON_DEPTH` or inflate past `trie.NAMES_BYTES_PER_SESSION`),
so metadata past either would make the whole archive unreadable. `prepare_session` turns
`add`'s arguments into the trie source to write and what its report says.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from seqkv_cli.archive import (
    Schedule,
    StoredKV,
    check_positive_number,
    coder_with_tolerance,
    kv_to_store,
    residual_to_use,
)
from seqkv_cli.container.schema import SchemaViolation, check_json_value
from seqkv_cli.errors import SeqkvError
from seqkv_cli.kvcapture.caches import cache_positions
from seqkv_cli.kvcapture.engine import canonical_model, provenance
from seqkv_cli.trie import MAX_JSON_DEPTH, NAMES_BYTES_PER_SESSION, Source, too_deep

if TYPE_CHECKING:
    from seqkv_cli.runtime.loading import LoadedModel
    from seqkv_cli.sequential.session_codec import SessionCodec

MAX_ID_CHARS = 1024


def check_session_id(session_id: object) -> str:
    if not isinstance(session_id, str) or not session_id:
        raise SeqkvError(f"a session id must be a non-empty string, not {session_id!r}")
    if len(session_id) > MAX_ID_CHARS or any(ord(c) < 32 or ord(c) == 127 for c in session_id):
        raise SeqkvError(
            f"session id {session_id[:40]!r}: at most {MAX_ID_CHARS} characters, "
            "no control characters"
        )
    return session_id


def token_list(input_ids: object, vocab_size: int) -> list[int]:
    """Token ids from a list, a 1-D tensor/array, or a (1, n) batch."""
    arr = input_ids.detach().cpu().numpy() if isinstance(input_ids, torch.Tensor) else input_ids
    try:
        arr = np.asarray(arr)
    except (TypeError, ValueError):
        raise SeqkvError("input_ids must be a list of ints, a tensor or an array") from None
    if arr.ndim == 2 and arr.shape[0] == 1:
        arr = arr[0]
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise SeqkvError(
            f"input_ids must be one sequence of integer ids (n,) or (1, n), got shape "
            f"{tuple(arr.shape)} of {arr.dtype}"
        )
    if arr.size == 0:
        raise SeqkvError("input_ids is empty: nothing to store")
    low, high = int(arr.min()), int(arr.max())
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise SeqkvError(f"token id {bad} is outside the model's vocabulary (0..{vocab_size - 1})")
    return [int(t) for t in arr]


def check_fits_context(session_id: str, ids: list[int], lm: LoadedModel) -> None:
    """A session no longer than the model's context (what its canonical forward can run)."""
    if len(ids) > lm.max_context:
        raise SeqkvError(
            f"session {session_id!r} has {len(ids)} tokens, more than the model context "
            f"({lm.max_context})"
        )


USER_META_KEY = "meta"  # where a session's `add(meta=...)` is kept in its capture metadata
# The segment's names hold the user's dict four levels down: {"sessions": [[id, {"meta": ...}]]}
# or {"profiles": [{"capture_meta": {"meta": ...}}]}.
MAX_META_DEPTH = MAX_JSON_DEPTH - 4
MAX_META_BYTES = NAMES_BYTES_PER_SESSION


def check_meta(meta: object) -> dict:
    """`add(meta=...)`: a dict of JSON-plain values that the archive index holds and gives back
    as it was; a one-line SeqkvError for anything else."""
    if meta is None:
        return {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) for k in meta):
        raise SeqkvError("meta must be a dict with string keys")
    for key, value in meta.items():
        if not isinstance(value, str | int | float | dict) or value is None:
            raise SeqkvError(
                f"meta[{key!r}] is {type(value).__name__}; values must be str, int, float, "
                "bool or dict"
            )
    if too_deep(meta, MAX_META_DEPTH):  # iterative: a 5,000-deep dict is no RecursionError
        raise SeqkvError(f"meta nests dicts and lists deeper than {MAX_META_DEPTH} levels")
    try:
        check_json_value(meta, "meta")  # NaN, non-string keys, tuples, sets, lone surrogates
    except SchemaViolation as exc:
        raise SeqkvError(f"meta is not JSON-plain: {exc}") from None
    text = json.dumps(meta, allow_nan=False)
    if len(text) > MAX_META_BYTES:
        raise SeqkvError(f"meta is {len(text)} bytes of JSON; at most {MAX_META_BYTES:,}")
    return json.loads(text)


def stored_meta(entry: dict) -> dict:
    """The user metadata of an index entry ({} if none)."""
    meta = entry.get("capture_meta", {}).get(USER_META_KEY, {})
    return dict(meta) if isinstance(meta, dict) else {}


@dataclass(frozen=True)
class Loaded:
    """A cache that `load` handed out: the positions it held and the forward calls that filled
    it (the session's replay record; one prefill where it had none)."""

    positions: int
    calls: tuple[int, ...]

    @classmethod
    def of(cls, positions: int, runs: list | None) -> Loaded:
        calls = (positions,) if runs is None else Schedule.from_runs(runs).calls
        return cls(positions, tuple(calls))


def generated_arguments(args: dict, loaded: Callable[[object], Loaded | None]) -> dict:
    """`add`'s arguments with a generate() output unpacked (its sequences up to what its cache
    covers, and the cache), and the schedule of a cache `load` gave (`loaded(cache)`) that
    generate() continued from `prompt_length` tokens. Anything else is left as given."""
    out = args["input_ids"]
    if hasattr(out, "sequences") and hasattr(out, "past_key_values"):
        if args["cache"] is not None:
            raise SeqkvError("add: give a generate() output or a cache, not both")
        cache = out.past_key_values
        if cache is None:
            raise SeqkvError(
                "add: this generate() output holds no cache (use_cache=False?); pass its "
                "sequences to store tokens only"
            )
        n = cache_positions(cache)
        args = dict(args, input_ids=out.sequences[..., :n], cache=cache)
        scores = getattr(out, "scores", None) or getattr(out, "logits", None)
        if args["prompt_length"] is None and args["schedule"] is None and scores:
            args["prompt_length"] = int(out.sequences.shape[-1]) - len(scores)
    origin = loaded(args["cache"]) if args["cache"] is not None else None
    if origin is None or args["schedule"] is not None or args["prompt_length"] is None:
        return args
    prompt, n = args["prompt_length"], cache_positions(args["cache"])
    if (
        isinstance(prompt, bool)
        or not isinstance(prompt, int)
        or not origin.positions < prompt <= n
    ):
        raise SeqkvError(
            f"prompt_length must be in {origin.positions + 1}..{n}: the loaded cache held "
            f"{origin.positions} positions, generate() filled it to {n}; got {prompt!r}"
        )
    schedule = [*origin.calls, prompt - origin.positions] + [1] * (n - prompt)
    return dict(args, schedule=schedule, prompt_length=None)


@dataclass(frozen=True)
class PreparedSession:
    """One session of an `add_many`, ready to write, and what its report will say."""

    session_id: str
    tokens: int
    source: object  # a trie.sources.Source
    kept: StoredKV


def prepare_session(
    lm: LoadedModel, runner: torch.nn.Module, coder: SessionCodec, sid: str, args: dict
) -> PreparedSession:
    """Session `sid` (a checked id) with `add`'s arguments `args` (by name, defaults filled in),
    for an archive of `lm` coded by `coder`; `runner` is the user's model a replay re-runs."""
    ids = token_list(args["input_ids"], lm.vocab_size)
    meta = check_meta(args["meta"])
    cache, tolerance = args["cache"], args["tolerance"]
    how_filled = (args["prompt_length"], args["schedule"])
    residual = residual_to_use(
        args["residual"],
        tolerance,
        has_cache=cache is not None,
        describes_filling=how_filled != (None, None),
    )
    own_coder = None if tolerance is None else coder_with_tolerance(coder, tolerance)
    limit = args["max_relative_difference"]
    if limit is not None:
        check_positive_number("max_relative_difference", limit)
    check_fits_context(sid, ids, lm)
    kept = kv_to_store(
        lm,
        runner,
        coder.numerics,
        sid,
        ids,
        cache,
        residual=residual,
        tolerance=tolerance,
        how_filled=how_filled,
        limit=limit,
    )
    if kept.capture is None:  # tokens only: a second forward would compute what encoding does
        path = canonical_model(lm, coder.numerics).numeric_path
        base = provenance(lm, dtype="bf16", numeric_path=path, positions=len(ids))
        source = Source.tokens_only(sid, ids, dict(base, **({USER_META_KEY: meta} if meta else {})))
        return PreparedSession(sid, len(ids), source, kept)
    if meta:
        kept.capture.meta[USER_META_KEY] = meta
    return PreparedSession(sid, len(ids), Source.from_capture(kept.capture, own_coder), kept)


def add_arguments(item: dict, defaults: dict) -> dict:
    """One `add_many` item as `add`'s arguments (`defaults`: add()'s, by name) filled in."""
    import inspect

    names, required = set(item), {n for n, v in defaults.items() if v is inspect.Parameter.empty}
    if names - set(defaults) or not names >= required:
        raise SeqkvError(
            "add_many: each session is a mapping with session_id, input_ids and "
            f"add()'s keyword arguments (got {sorted(item)})"
        )
    return {name: item.get(name, default) for name, default in defaults.items()}
