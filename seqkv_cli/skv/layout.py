"""Section names and session entries: how captures are laid out inside a container."""

from __future__ import annotations


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
        "capture_meta": {k: v for k, v in meta.items() if isinstance(v, str | int | float | dict)},
    }
