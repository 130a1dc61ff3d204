"""A session's user metadata (`add(meta=...)`): checked where it enters, read back from the
index."""

from __future__ import annotations

import json

from seqkv_cli.errors import SeqkvError

USER_META_KEY = "meta"  # where a session's `add(meta=...)` is kept in its capture metadata


def check_meta(meta) -> dict:
    """`add(meta=...)`: a dict of JSON-plain values (what the archive index can hold)."""
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
    try:
        text = json.dumps(meta, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise SeqkvError(f"meta is not JSON-plain: {exc}") from None
    if len(text) > 65536:
        raise SeqkvError(f"meta is {len(text)} bytes of JSON; at most 65,536")
    return json.loads(text)


def stored_meta(entry: dict) -> dict:
    """The user metadata of an index entry ({} if none)."""
    meta = entry.get("capture_meta", {}).get(USER_META_KEY, {})
    return dict(meta) if isinstance(meta, dict) else {}
