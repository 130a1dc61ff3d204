"""Capture files: safetensors holding one session's K/V, token ids, surprisal and metadata.

Layout (spec in docs/FORMAT.md): tensors ``tokens`` (int64, n), ``surprisal`` (float64, n - 1:
bits of token i + 1 given tokens 0..i; the first token has none), ``layers.{i}.key`` and
``layers.{i}.value`` (num_kv_heads, n, head_dim) in the captured dtype, keys after RoPE as
transformers caches them; string metadata under ``__metadata__``.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch

from seqkv_cli.errors import SeqkvError
from seqkv_cli.fsutil import atomic_path

CAPTURE_FORMAT = "seqkv.capture"
CAPTURE_VERSION = 1
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}  # torch dtype -> the name files store
MAX_TOKEN_ID = 2**32 - 1  # containers store token ids as <u4
_COUNTS = ("positions", "num_layers", "num_kv_heads", "head_dim")


@dataclass
class Capture:
    """One captured session. `keys`/`values`: per layer, (num_kv_heads, n, head_dim)."""

    tokens: torch.Tensor
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    surprisal: torch.Tensor
    meta: dict = field(default_factory=dict)
    # Residual parts still to apply on another session's K/V ((kind, layer) -> (base local
    # index, positions, stream)): set between a trie path's decode and the finish in
    # archive.restore_trie.
    deferred: dict = field(default_factory=dict, repr=False)
    # Set on restore by codecs that add a stored residual to K/V they predict or recompute:
    # {"key": [per layer], "value": [per layer]}, the 95th percentile of |residual| over a
    # layer's elements (0.0 where a layer stores none); None where K/V are stored directly.
    residual_p95: dict | None = field(default=None, repr=False)

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
    try:
        # safetensors stages `.tmpXXXXXX` beside the file it writes: in a folder of this run
        # (`own_dir`), a writer killed meanwhile leaves nothing the next one cannot remove
        with atomic_path(Path(path), own_dir=True) as tmp:  # umask-respecting, renamed in place
            write_capture(capture, tmp, Path(path))
        return Path(path).stat().st_size
    except OSError as exc:  # disk full, read-only: one line, nothing left behind
        raise SeqkvError(f"cannot write {path}: {exc.strerror or exc}") from None


def write_capture(capture: Capture, path: Path, target: Path) -> None:
    """Write the capture file at `path` as it is (not atomically): for a caller that staged
    `path` in a `fsutil.staging_dir` and publishes it as `target` (named in messages)."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    check_capture(capture, f"{target}: not written")
    tensors = {
        "tokens": capture.tokens.to(torch.int64).contiguous(),
        "surprisal": capture.surprisal.to(torch.float64).contiguous(),
    }
    for i, (k, v) in enumerate(zip(capture.keys, capture.values, strict=True)):
        tensors[f"layers.{i}.key"] = k.contiguous()
        tensors[f"layers.{i}.value"] = v.contiguous()
    meta = {k: v if isinstance(v, str) else json.dumps(v) for k, v in capture.meta.items()}
    meta.update(format=CAPTURE_FORMAT, format_version=str(CAPTURE_VERSION))  # never the caller's
    try:
        save_file(tensors, path, metadata=meta)
        _sort_metadata(path)
    except (OSError, SafetensorError) as exc:  # disk full, read-only: one line
        why = getattr(exc, "strerror", None) or exc
        raise SeqkvError(f"cannot write {target}: {why}") from None


def _sort_metadata(path: Path) -> None:
    """Rewrite the header of the safetensors file just written at ``path`` with its metadata
    keys sorted, in place: safetensors writes them in a hash map's order, which changes from
    process to process, so the same capture would otherwise differ in bytes run to run (a
    restore could not be compared by checksum). Same length (padded with the spaces
    safetensors pads with); the tensors and their offsets are untouched."""
    with open(path, "r+b") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
        if "__metadata__" in header:
            header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        if len(text) > length:  # not for JSON safetensors wrote; never move the tensors
            return
        f.seek(8)
        f.write(text.ljust(length, b" "))


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
    version = raw_meta.get("format_version", "0")
    if not (version.isascii() and version.isdigit()):
        raise SeqkvError(f"{path}: damaged capture metadata (format_version {version[:20]!r})")
    if int(version) > CAPTURE_VERSION:
        raise SeqkvError(f"{path} was written by a newer seqkv (capture v{version}); upgrade")
    meta = {}
    for key, value in raw_meta.items():
        if key in ("format", "format_version"):
            continue
        try:
            meta[key] = json.loads(value) if key in _JSON_META else value
        except (ValueError, RecursionError):
            raise SeqkvError(f"{path}: damaged capture metadata ({key})") from None
    _check_meta(path, meta)
    return path, meta, names, tensors


def _check_meta(path: Path, meta: dict) -> None:
    """What compress and decompress rely on: a known dtype and whole, sane counts."""
    for key in ("positions", "dtype"):
        if key not in meta:
            raise SeqkvError(f"{path}: capture metadata lacks {key!r}; not a complete capture")
    if meta["dtype"] not in DTYPES:
        raise SeqkvError(
            f"{path}: capture dtype {str(meta['dtype'])[:20]!r} is not one of {', '.join(DTYPES)}"
        )
    for key in _COUNTS:
        value = meta.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**31:
            raise SeqkvError(f"{path}: capture metadata {key}={str(value)[:20]} is not a count")


def load_capture_meta(path: Path | str) -> dict:
    """A capture's metadata, without reading its tensors."""
    return _read(path, with_tensors=False)[1]


def load_capture_tokens(path: Path | str):
    """(metadata, token ids) of a capture, without reading its K/V."""
    path, meta, _, tensors = _read(path, with_tensors=True, only=("tokens",))
    if "tokens" not in tensors:
        raise SeqkvError(f"{path} is missing tensor 'tokens'")
    return meta, _check_tokens(path, tensors["tokens"], meta)


def load_capture(path: Path | str) -> Capture:
    """Read a capture file, checking its format marker, version, and that metadata and
    tensors agree (shapes, dtype, token range): what passes here can be compressed."""
    path, meta, names, tensors = _read(path, with_tensors=True)
    n_layers = sum(1 for n in names if n.endswith(".key"))
    try:
        keys = [tensors[f"layers.{i}.key"] for i in range(n_layers)]
        values = [tensors[f"layers.{i}.value"] for i in range(n_layers)]
        tokens, surprisal = tensors["tokens"], tensors["surprisal"]
    except KeyError as exc:
        raise SeqkvError(f"{path} is missing tensor {exc.args[0]}") from None
    tokens = _check_parts(path, tokens, keys, values, surprisal, meta)
    return Capture(tokens, keys, values, surprisal, meta)


def _check_parts(path, tokens, keys, values, surprisal, meta: dict) -> torch.Tensor:
    """Metadata and tensors agree: the checks `load_capture` makes, shared with the writer."""
    tokens = _check_tokens(path, tokens, meta)
    n = int(tokens.shape[0])
    if surprisal.dim() != 1 or not surprisal.is_floating_point():
        raise SeqkvError(f"{path}: tensor surprisal must be 1-D floats")
    if surprisal.shape[0] != max(n - 1, 0):
        raise SeqkvError(f"{path}: tensor lengths disagree with {n} tokens")
    _check_kv(path, keys, values, n, meta)
    return tokens


def check_capture(capture: Capture, where: str) -> None:
    """Refuse, in one line naming `where`, a capture whose metadata contradicts its tensors
    (a header field changed and re-signed): what `load_capture` would refuse is never
    written, verified as good or handed on."""
    meta = capture.meta
    _check_meta(where, meta)
    if len(capture.keys) != len(capture.values):
        raise SeqkvError(f"{where}: {len(capture.keys)} key layers, {len(capture.values)} value")
    _check_parts(where, capture.tokens, capture.keys, capture.values, capture.surprisal, meta)


def _check_tokens(path: Path, tokens: torch.Tensor, meta: dict) -> torch.Tensor:
    """1-D integer ids in [0, 2^32): checked before anything casts them to <u4, where a
    negative or huge id would wrap silently into another token."""
    if tokens.dim() != 1 or tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
        raise SeqkvError(f"{path}: tensor tokens must be 1-D integers, got {tokens.dtype}")
    if tokens.dtype.is_complex:
        raise SeqkvError(f"{path}: tensor tokens must be 1-D integers, got {tokens.dtype}")
    if int(tokens.shape[0]) != meta["positions"]:
        raise SeqkvError(
            f"{path}: {tokens.shape[0]} tokens, but the metadata says {meta['positions']} positions"
        )
    if tokens.numel():
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi > MAX_TOKEN_ID:
            bad = lo if lo < 0 else hi
            raise SeqkvError(f"{path}: token id {bad} is out of range (ids are 0..2^32-1)")
    return tokens.to(torch.int64)


def tokens_as_u4(tokens: torch.Tensor, where: str) -> bytes:
    """Token ids as little-endian uint32 bytes, refusing ids that would wrap in the cast."""
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) > MAX_TOKEN_ID):
        raise SeqkvError(f"{where}: token ids must lie in 0..2^32-1 to be stored")
    return tokens.numpy().astype("<u4").tobytes()


def _check_kv(path: Path, keys: list, values: list, n: int, meta: dict) -> None:
    """Every K/V tensor (heads, n, head_dim) in the capture's dtype, one shape for all."""
    want = DTYPES[meta["dtype"]]
    first = None
    for i, t in enumerate(x for pair in zip(keys, values, strict=True) for x in pair):
        name = f"layers.{i // 2}.{'key' if i % 2 == 0 else 'value'}"
        if t.dim() != 3:
            raise SeqkvError(f"{path}: tensor {name} must be (heads, positions, head_dim)")
        if t.dtype != want:
            raise SeqkvError(
                f"{path}: tensor {name} is {str(t.dtype).removeprefix('torch.')}, but the "
                f"capture says {meta['dtype']}; not a consistent capture"
            )
        if t.shape[1] != n:
            raise SeqkvError(f"{path}: tensor lengths disagree with {n} tokens")
        first = first or (t.shape[0], t.shape[2])
        if (t.shape[0], t.shape[2]) != first:
            raise SeqkvError(f"{path}: tensor {name} has another shape than layers.0.key")
    _check_shape_meta(path, meta, len(keys), first)


def _check_shape_meta(path: Path, meta: dict, n_layers: int, first) -> None:
    if first is None:
        raise SeqkvError(f"{path}: capture holds no K/V layers")
    found = {"num_layers": n_layers, "num_kv_heads": first[0], "head_dim": first[1]}
    for key, value in found.items():
        if key in meta and meta[key] != value:
            raise SeqkvError(
                f"{path}: metadata says {key}={meta[key]}, the tensors have {value}; "
                "not a consistent capture"
            )
