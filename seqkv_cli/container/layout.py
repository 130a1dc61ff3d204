"""Section names and session entries: how captures are laid out inside a container."""

from __future__ import annotations

# Capture metadata that the entry or the header's `model` already holds: not repeated per
# session (it would cost ~400 bytes each), put back by `capture_meta_of` on restore.
STORED_ELSEWHERE = {
    "session_id",
    "dtype",
    "numeric_path",
    "positions",
    "num_layers",
    "num_kv_heads",
    "head_dim",
    "model_fingerprint",
    "tokenizer_fingerprint",
    "model_name",
}


def capture_meta_of(entry: dict, model: dict) -> dict:
    """A restored capture's metadata: the stored part plus what entry and model hold."""
    shapes = entry["shapes"]
    meta = dict(entry.get("capture_meta", {}))
    meta.update(
        {
            "session_id": entry["id"],
            "dtype": entry["dtype"],
            "numeric_path": entry.get("numeric_path", "unknown"),
            "positions": entry["positions"],
            "num_layers": shapes["num_layers"],
            "num_kv_heads": shapes["num_kv_heads"],
            "head_dim": shapes["head_dim"],
        }
    )
    for key, field in (
        ("model_fingerprint", "fingerprint"),
        ("tokenizer_fingerprint", "tokenizer_fingerprint"),
        ("model_name", "name"),
    ):
        if model and field in model:
            meta[key] = model[field]
    return meta


def section_name(session_index: int, part: str) -> str:
    return f"s{session_index}/{part}"


def kv_part(layer: int, kind: str) -> str:
    return f"layers.{layer}.{kind}"


def session_entry(index: int, cap, sections: list[str]) -> dict:
    """The header's description of one session: enough to rebuild the capture file."""
    meta = cap.meta
    return {
        "id": cap.session_id,
        "index": index,
        "positions": cap.positions,
        "dtype": meta["dtype"],
        "shapes": {
            "num_layers": len(cap.keys),
            "num_kv_heads": int(cap.keys[0].shape[0]),
            "head_dim": int(cap.keys[0].shape[2]),
        },
        "sections": sections,
        "numeric_path": meta.get("numeric_path", "unknown"),
        "log2_ppl": round(cap.log2_ppl, 6) if cap.positions > 1 else None,
        "capture_meta": {  # sorted: a capture file's metadata order varies between runs
            k: meta[k]
            for k in sorted(meta)
            if isinstance(meta[k], str | int | float | dict) and k not in STORED_ELSEWHERE
        },
    }
