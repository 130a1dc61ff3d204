"""Capture files: safetensors holding one session's K/V, token ids, surprisal and metadata.

Layout (spec in docs/FORMAT.md): tensors ``tokens`` (int64, n), ``surprisal`` (float64, n - 1:
bits of token i + 1 given tokens 0..i; the first token has none), ``layers.{i}.key`` and
``layers.{i}.value`` (num_kv_heads, n, head_dim) in the captured dtype, keys after RoPE as
transformers caches them; string metadata under ``__metadata__``.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from seqkv_cli.errors import SeqkvError

CAPTURE_FORMAT = "seqkv.capture"
CAPTURE_VERSION = 1
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class Capture:
    """One captured session. `keys`/`values`: per layer, (num_kv_heads, n, head_dim)."""

    tokens: torch.Tensor
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    surprisal: torch.Tensor
    meta: dict = field(default_factory=dict)

    @property
    def positions(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def session_id(self) -> str:
        return self.meta.get("session_id", "session")

    @property
    def log2_ppl(self) -> float:
        """Mean surprisal in bits (log2 of the perplexity) over the positions that have one."""
        return float(self.surprisal.mean()) if self.surprisal.numel() else float("nan")

    def kv_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


def save_capture(capture: Capture, path: Path) -> int:
    """Write atomically (temp file + rename); return the bytes written."""
    from safetensors.torch import save_file

    tensors = {
        "tokens": capture.tokens.to(torch.int64).contiguous(),
        "surprisal": capture.surprisal.to(torch.float64).contiguous(),
    }
    for i, (k, v) in enumerate(zip(capture.keys, capture.values, strict=True)):
        tensors[f"layers.{i}.key"] = k.contiguous()
        tensors[f"layers.{i}.value"] = v.contiguous()
    meta = {"format": CAPTURE_FORMAT, "format_version": str(CAPTURE_VERSION)}
    meta.update({k: v if isinstance(v, str) else json.dumps(v) for k, v in capture.meta.items()})
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=meta)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path.stat().st_size


_JSON_META = {"num_layers", "num_kv_heads", "head_dim", "positions", "versions", "truncated"}


def _read(path: Path | str, *, with_tensors: bool, only: tuple[str, ...] | None = None):
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise SeqkvError(f"no such capture file: {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            raw_meta = f.metadata() or {}
            names = set(f.keys())
            wanted = names if only is None else names & set(only)
            tensors = {n: f.get_tensor(n) for n in wanted} if with_tensors else {}
    except (SafetensorError, OSError, ValueError) as exc:
        raise SeqkvError(f"{path} is not a capture file (not safetensors: {exc})") from None
    if raw_meta.get("format") != CAPTURE_FORMAT:
        raise SeqkvError(f"{path} is a safetensors file but not a seqkv capture")
    version = int(raw_meta.get("format_version", "0"))
    if version > CAPTURE_VERSION:
        raise SeqkvError(f"{path} was written by a newer seqkv (capture v{version}); upgrade")
    try:
        meta = {
            k: (json.loads(v) if k in _JSON_META else v)
            for k, v in raw_meta.items()
            if k not in ("format", "format_version")
        }
    except ValueError:
        raise SeqkvError(f"{path}: damaged capture metadata") from None
    return path, meta, names, tensors


def load_capture_meta(path: Path | str) -> dict:
    """A capture's metadata, without reading its tensors."""
    return _read(path, with_tensors=False)[1]


def load_capture_tokens(path: Path | str):
    """(metadata, token ids) of a capture, without reading its K/V."""
    path, meta, _, tensors = _read(path, with_tensors=True, only=("tokens",))
    if "tokens" not in tensors:
        raise SeqkvError(f"{path} is missing tensor 'tokens'")
    return meta, tensors["tokens"]


def load_capture(path: Path | str) -> Capture:
    """Read a capture file, checking its format marker and version."""
    path, meta, names, tensors = _read(path, with_tensors=True)
    n_layers = sum(1 for n in names if n.endswith(".key"))
    try:
        keys = [tensors[f"layers.{i}.key"] for i in range(n_layers)]
        values = [tensors[f"layers.{i}.value"] for i in range(n_layers)]
        tokens, surprisal = tensors["tokens"], tensors["surprisal"]
    except KeyError as exc:
        raise SeqkvError(f"{path} is missing tensor {exc.args[0]}") from None
    n = int(tokens.shape[0])
    if any(t.shape[1] != n for t in (*keys, *values)) or surprisal.shape[0] != max(n - 1, 0):
        raise SeqkvError(f"{path}: tensor lengths disagree with {n} tokens")
    return Capture(tokens, keys, values, surprisal, meta)


def to_dynamic_cache(capture: Capture, dtype: torch.dtype = torch.float32):
    """The capture as a `transformers` DynamicCache (batch 1), ready to continue generation."""
    from transformers import DynamicCache

    cache = DynamicCache()
    for i, (k, v) in enumerate(zip(capture.keys, capture.values, strict=True)):
        cache.update(k[None].to(dtype), v[None].to(dtype), i)
    return cache
