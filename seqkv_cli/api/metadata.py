"""A session's user metadata (`add(meta=...)`): refused at the door unless the archive can
hold it and read it back, and read back from the index.

The bounds are the reader's own: a trie segment's session names and profiles are refused
when they nest deeper than `trie.tables.MAX_JSON_DEPTH` or inflate past 64 KiB a session
(`NAMES_BYTES_PER_SESSION`), so metadata past either would make the whole archive unreadable.
"""

from __future__ import annotations

import json

from seqkv_cli.container.schema import SchemaViolation, check_json_value
from seqkv_cli.errors import SeqkvError
from seqkv_cli.trie import MAX_JSON_DEPTH, NAMES_BYTES_PER_SESSION, too_deep

USER_META_KEY = "meta"  # where a session's `add(meta=...)` is kept in its capture metadata
# The segment's names hold the user's dict four levels down: {"sessions": [[id, {"meta": ...}]]}
# or {"profiles": [{"capture_meta": {"meta": ...}}]}.
MAX_META_DEPTH = MAX_JSON_DEPTH - 4
MAX_META_BYTES = NAMES_BYTES_PER_SESSION


def check_meta(meta) -> dict:
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
