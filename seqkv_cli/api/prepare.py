"""One session given to `add`/`add_many` -> the trie source to write and what its report
says; every check the arguments alone can fail comes before any model work."""

from __future__ import annotations

from dataclasses import dataclass

from seqkv_cli.api.arguments import check_fits_context, token_list
from seqkv_cli.api.metadata import USER_META_KEY, check_meta
from seqkv_cli.api.stored_kv import StoredKV, kv_to_store
from seqkv_cli.skv.residual_policy import (
    check_positive_number,
    coder_with_tolerance,
    residual_to_use,
)


@dataclass(frozen=True)
class PreparedSession:
    """One session of an `add_many`, ready to write, and what its report will say."""

    session_id: str
    tokens: int
    source: object  # a trie.sources.Source
    kept: StoredKV


def prepare_session(lm, runner, coder, sid: str, args: dict) -> PreparedSession:
    """Session `sid` (a checked id) with `add`'s arguments `args` (by name, defaults filled in),
    for an archive of `lm` coded by `coder`; `runner` is the user's model a replay re-runs."""
    from seqkv_cli.trie import Source

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
    if meta:
        kept.capture.meta[USER_META_KEY] = meta
    return PreparedSession(sid, len(ids), Source.from_capture(kept.capture, own_coder), kept)
