"""Which model a container belongs to, and which seqkv wrote it.

A container holds sessions of one model: its header names the model by fingerprint, and a
model-backed codec restores with that model's canonical forward only.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from seqkv_cli.container.compact import FINGERPRINT_HEX
from seqkv_cli.errors import SeqkvError
from seqkv_cli.kvcapture.engine import canonical_model
from seqkv_cli.runtime.loading import LoadedModel, load_model
from seqkv_cli.version import __version__

if TYPE_CHECKING:
    from seqkv_cli.kvcapture.capture_file import Capture
    from seqkv_cli.trie import Source


def load_canonical(model: str | LoadedModel | None, numerics: str):
    """The canonical forward of `model` (spec, LoadedModel or None = embedded) on the numeric
    path `numerics`, and the model's identity (the header's `model` object)."""
    lm = model if isinstance(model, LoadedModel) else load_model(model)
    return canonical_model(lm, numerics), model_identity(lm)


def model_identity(lm: LoadedModel) -> dict:
    """The header's `model` object: what names the model a file's sessions belong to."""
    return {
        "fingerprint": lm.fingerprint,
        "tokenizer_fingerprint": lm.tokenizer_fingerprint,
        "name": lm.name,
    }


def fingerprint_matches(stored: str, actual: str) -> bool:
    """Whether a file's model fingerprint names `actual`: equal, or, in a compact file
    (format 1.2), its first 16 hex digits (8 bytes: a wrong model passes with odds 2**-64)."""
    if stored == actual:
        return True
    return len(stored) == FINGERPRINT_HEX and actual.startswith(stored)


def same_model(model: dict | None, cap: Capture | Source, path: Path) -> dict:
    """The identity of capture `cap`, refused if it is not the model seen so far (`model`)."""
    this = {
        "fingerprint": cap.meta.get("model_fingerprint", "unknown"),
        "tokenizer_fingerprint": cap.meta.get("tokenizer_fingerprint", "unknown"),
        "name": cap.meta.get("model_name", "unknown"),
    }
    if model is not None and model["fingerprint"] != this["fingerprint"]:
        raise SeqkvError(
            f"{path} comes from a different model ({this['fingerprint'][:12]} vs "
            f"{model['fingerprint'][:12]}); compress captures of one model per container"
        )
    return model or this


def writer_version() -> str:
    """The header's `meta.writer`."""
    return f"seqkv {__version__}"
