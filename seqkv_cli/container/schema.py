"""What a container header may hold, checked identically on write and on read.

The header is plain JSON so that any language can read an `.skv` file; these checks make sure
what goes in comes back out *exactly* (no tuples turning into lists, no NaN, no lone
surrogates) and that every session names sections the file really holds.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection
from typing import Any

MAX_DEPTH = 64
MAX_NAME_BYTES = 1024
KNOWN_KEYS = ("pipeline", "model", "sessions", "meta", "trie")
REQUIRED_KEYS = ("pipeline", "model", "sessions")


class SchemaViolation(Exception):
    """Internal: a header or index breaks a rule; callers re-raise it with the file path."""


def check_json_value(value: Any, where: str, depth: int = 0) -> None:
    """Refuse anything `json` would not round-trip exactly (tuples, NaN, non-str keys...)."""
    if depth > MAX_DEPTH:
        raise SchemaViolation(f"{where} is nested deeper than {MAX_DEPTH} levels")
    if value is None or isinstance(value, bool | int):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise SchemaViolation(f"{where} is {value!r}; JSON has no NaN or infinity")
        return
    if isinstance(value, str):
        check_text(value, where)
        return
    if isinstance(value, list):
        for i, item in enumerate(value):
            check_json_value(item, f"{where}[{i}]", depth + 1)
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise SchemaViolation(f"{where} has a non-string key {key!r}")
            check_text(key, f"{where} key")
            check_json_value(item, f"{where}[{key!r}]", depth + 1)
        return
    raise SchemaViolation(
        f"{where} is a {type(value).__name__}; use only dict, list, str, int, float, bool, None"
    )


def check_text(text: str, where: str) -> None:
    """Strings must be valid Unicode scalar values, or UTF-8 encoding fails later."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise SchemaViolation(f"{where} is not valid Unicode ({error.reason})") from None


def check_section_name(name: Any) -> None:
    """Names appear in one-line error messages, so they must be short printable text."""
    if not isinstance(name, str) or not name:
        raise SchemaViolation(f"section name {name!r} must be a non-empty string")
    check_text(name, f"section name {name!r}")
    if len(name.encode("utf-8")) > MAX_NAME_BYTES:
        raise SchemaViolation(f"section name {name[:40]!r}... is over {MAX_NAME_BYTES} bytes")
    if any(ord(c) < 32 or 127 <= ord(c) < 160 for c in name):
        raise SchemaViolation(f"section name {name!r} contains control characters")


def check_header(header: Any, section_names: Collection[str], *, strict: bool) -> None:
    """Check header structure; `strict` (the writer) also refuses unknown top-level keys.

    Readers are lenient about unknown keys because a newer minor version may add some.
    """
    if not isinstance(header, dict):
        raise SchemaViolation(f"header must be a dict, not {type(header).__name__}")
    check_json_value(header, "header")
    missing = [key for key in REQUIRED_KEYS if key not in header]
    if missing:
        raise SchemaViolation(f"header is missing {', '.join(map(repr, missing))}")
    unknown = [key for key in header if key not in KNOWN_KEYS]
    if strict and unknown:
        raise SchemaViolation(f"header has unknown key {unknown[0]!r}; put extra data in 'meta'")
    pipeline = header["pipeline"]
    if not isinstance(pipeline, list):
        raise SchemaViolation("header['pipeline'] must be a list of codec configs")
    for i, config in enumerate(pipeline):
        if not isinstance(config, dict) or not isinstance(config.get("id"), str):
            raise SchemaViolation(f"header['pipeline'][{i}] must be a dict with a string 'id'")
    model = header["model"]
    if model is not None and not (
        isinstance(model, dict) and isinstance(model.get("fingerprint"), str)
    ):
        raise SchemaViolation("header['model'] must be null or a dict with a string 'fingerprint'")
    if not isinstance(header.get("meta", {}), dict):
        raise SchemaViolation("header['meta'] must be a dict")
    check_sessions(header["sessions"], set(section_names))


def check_sessions(sessions: Any, section_names: set[str]) -> None:
    """Each session has a unique id, typed fields, and names only sections the file holds."""
    if not isinstance(sessions, list):
        raise SchemaViolation("header['sessions'] must be a list of session dicts")
    seen: set[str] = set()
    for i, session in enumerate(sessions):
        where = f"header['sessions'][{i}]"
        if not isinstance(session, dict):
            raise SchemaViolation(f"{where} must be a dict")
        sid = session.get("id")
        if not isinstance(sid, str) or not sid:
            raise SchemaViolation(f"{where}['id'] must be a non-empty string")
        if sid in seen:
            raise SchemaViolation(f"session id {sid!r} appears twice")
        seen.add(sid)
        positions = session.get("positions")
        if isinstance(positions, bool) or not isinstance(positions, int) or positions < 0:
            raise SchemaViolation(f"{where}['positions'] must be an integer >= 0")
        if not isinstance(session.get("dtype"), str):
            raise SchemaViolation(f"{where}['dtype'] must be a string")
        if not isinstance(session.get("shapes"), dict | list):
            raise SchemaViolation(f"{where}['shapes'] must be a dict or a list")
        names = session.get("sections")
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise SchemaViolation(f"{where}['sections'] must be a list of section names")
        if len(set(names)) != len(names):
            raise SchemaViolation(f"session {sid!r} lists a section twice")
        absent = [n for n in names if n not in section_names]
        if absent:
            raise SchemaViolation(f"session {sid!r} names section {absent[0]!r}, which is absent")


def encode_json(obj: Any) -> bytes:
    """Compact UTF-8 JSON; key order is kept so the header reads back as it was written."""
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def decode_json(raw: bytes) -> Any:
    """Parse strictly: duplicate keys, NaN/Infinity and bad UTF-8 raise SchemaViolation."""

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        result = dict(pairs)
        if len(result) != len(pairs):
            raise SchemaViolation("the index JSON repeats a key inside one object")
        return result

    def no_constants(token: str) -> Any:
        raise SchemaViolation(f"the index JSON contains {token}, which is not JSON")

    try:
        return json.loads(
            raw.decode("utf-8"), object_pairs_hook=no_duplicates, parse_constant=no_constants
        )
    except (ValueError, RecursionError) as error:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise SchemaViolation(f"the index is not valid JSON ({reason})") from None
