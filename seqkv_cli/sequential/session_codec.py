"""The session-codec interface: a codec that sees a whole session and needs the model.

A session codec stores token ids and restores K/V by recomputing it on the canonical path,
plus a residual for whatever recomputation does not reproduce bit for bit. Subclasses say
how tokens are coded (`encode_tokens`/`decode_tokens_many`) and declare what they can do in
class attributes the rest of seqkv reads instead of comparing codec ids:

* ``steps_model`` - token ids are coded under the model's next-token distribution, so
  decoding steps the model once per token and a token costs its surprisal (`seq`);
* ``trie_capable`` - sessions can share prefixes in a trie archive (all but `delta-topk`,
  whose residual is predicted per session);
* ``takes_residual`` - accepts ``residual=`` and ``tolerance=`` (the recomputing codecs);
* ``needs_canonical`` - restore runs the canonical forward (true for every session codec;
  per-vector codecs of the codec library have it false, see registry.capabilities);
* ``lossless`` - restore is bit-exact (an instance attribute: a tolerance makes it lossy).

Codecs are found through sequential/registry.py (built-ins and the
``seqkv.session_codecs`` entry-point group).
"""

from __future__ import annotations

import math
from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from seqkv_cli.errors import SeqkvError
from seqkv_cli.kvcapture.capture_file import DTYPES, Capture
from seqkv_cli.runtime.numerics import DEFAULT as DEFAULT_NUMERICS
from seqkv_cli.runtime.numerics import LEGACY as LEGACY_NUMERICS
from seqkv_cli.runtime.numerics import check_path
from seqkv_cli.sequential.adapter import CanonicalLogits
from seqkv_cli.sequential.surprisal_part import decode_surprisal_part, encode_surprisal_part
from seqkv_codecs.base import Configurable

if TYPE_CHECKING:
    from seqkv_cli.runtime.forward import CanonicalForward

RESIDUAL_MODES = ("lossless", "none")


@dataclass
class EncodedSession:
    parts: dict[str, bytes]
    token_bits_ideal: float
    residual_bytes: int = 0
    notes: list[str] = field(default_factory=list)


def kv_bits(t: torch.Tensor) -> np.ndarray:
    """A K/V tensor's bit patterns (uint16 for 2-byte dtypes, uint32 for fp32), for residuals."""
    t = t.contiguous()
    return (
        t.view(torch.int16).numpy().view(np.uint16)
        if t.element_size() == 2
        else t.view(torch.int32).numpy().view(np.uint32)
    )


def residual_p95(predicted: torch.Tensor, restored: torch.Tensor) -> float:
    """The 95th percentile of |restored - predicted| over a tensor's elements: the residual's
    magnitude the paper calibrates quantizer steps with (report's monitoring list)."""
    diff = (restored.double() - predicted.double()).abs().flatten()
    if not diff.numel():
        return 0.0
    return float(np.percentile(diff.nan_to_num(nan=float("inf")).numpy(), 95))


def kv_from_bits(bits: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    signed = np.int16 if bits.dtype == np.uint16 else np.int32
    return torch.from_numpy(bits.view(signed).copy()).view(dtype)


class SessionCodec(Configurable):
    codec_id: str
    description: str
    config_error = SeqkvError
    typical_bits_per_component = None
    lossless = True
    # capabilities (see the module docstring)
    steps_model = False
    trie_capable = True
    takes_residual = True
    needs_canonical = True

    def __init__(
        self,
        precision_bits: int = 24,
        chunk_size: int = 1024,
        residual: str = "lossless",
        tolerance: float | None = None,
        numerics: str = DEFAULT_NUMERICS,
    ) -> None:
        self.numerics = check_path(numerics)
        for name, value in (("precision_bits", precision_bits), ("chunk_size", chunk_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SeqkvError(f"{name} must be a positive integer, got {value!r}")
        if residual not in RESIDUAL_MODES:
            raise SeqkvError(f"unknown residual mode '{residual}'; use one of {RESIDUAL_MODES}")
        if tolerance is not None and not (
            isinstance(tolerance, int | float) and math.isfinite(tolerance) and tolerance > 0
        ):
            raise SeqkvError(f"--tolerance must be a finite number > 0, got {tolerance}")
        self.precision_bits, self.chunk_size, self.residual = precision_bits, chunk_size, residual
        self.tolerance = None if tolerance is None else float(tolerance)
        # With a tolerance, residuals below it are dropped: restore is within EPS, not exact.
        self.lossless = self.tolerance is None

    def get_config(self) -> dict:
        config = {
            "id": self.codec_id,
            "precision_bits": self.precision_bits,
            "chunk_size": self.chunk_size,
            "residual": self.residual,
            "numerics": self.numerics,
        }
        if self.tolerance is not None:
            config["tolerance"] = self.tolerance
        return config

    @classmethod
    def from_config(cls, config: dict) -> SessionCodec:
        # Files written before numeric paths were named were coded on the legacy forward.
        return super().from_config({"numerics": LEGACY_NUMERICS, **config})

    # -- to be provided by subclasses -------------------------------------------------------
    @abstractmethod
    def encode_tokens(self, tokens: np.ndarray, adapter: CanonicalLogits) -> tuple[bytes, float]:
        """The token stream and its ideal cost in bits; feeds `adapter` along the way."""

    @abstractmethod
    def decode_tokens_many(self, datas: list[bytes], adapter: CanonicalLogits) -> list:
        """Per stream: (tokens or the error that stopped it, the Track it fed or None)."""

    # -- shared -------------------------------------------------------------------------------
    def encode(self, cap: Capture, canon: CanonicalForward) -> EncodedSession:
        adapter = CanonicalLogits(canon)
        tokens = cap.tokens.numpy().astype(np.int64)
        data, ideal = self.encode_tokens(tokens, adapter)
        track = adapter.finish(adapter.tracks[-1] if adapter.tracks else None, tokens)
        out = EncodedSession({"tokens.seq": data}, ideal)
        dtype = DTYPES[cap.meta["dtype"]]
        keys, values = track.kv(canon.num_layers, dtype)
        for kind, captured, recomputed in (("key", cap.keys, keys), ("value", cap.values, values)):
            for layer, (a, b) in enumerate(zip(captured, recomputed, strict=True)):
                part = f"layers.{layer}.{kind}"
                self.add_residual(out, part, kv_bits(a), kv_bits(b), cap, track.unrounded)
        if not torch.equal(track.surprisal, cap.surprisal.double()):
            # Not expected for canonical captures; kept explicit so restore stays exact.
            out.parts["surprisal"] = encode_surprisal_part(cap.surprisal, track.surprisal)
            out.notes.append("surprisal differs from recomputation; stored against it")
        return out

    def add_residual(
        self, out: EncodedSession, part: str, captured, recomputed, cap, unrounded=None
    ) -> None:
        """Store in `out` what `recomputed` (bit patterns) misses of `captured`, if anything.

        `unrounded(kind, layer)` gives the recompute before its rounding to the capture's
        dtype; with it an exact residual is modelled on that rounding (`SKR2`), kept where it
        is smaller than the plain bit-pattern difference (`SKR1`) or the bounded one."""
        from seqkv_codecs.residual import encode_residual

        if np.array_equal(captured, recomputed):
            return
        if self.residual == "none":
            raise SeqkvError(
                f"capture {cap.session_id}: its tokens do not reproduce its own K/V ({part} "
                f"differs; numeric path {cap.meta.get('numeric_path')}); use --residual lossless"
            )
        if self.tolerance is not None:
            from seqkv_codecs.tolerance import encode_tolerance, is_empty

            data = encode_tolerance(captured, recomputed, cap.meta["dtype"], self.tolerance)
            if is_empty(data):
                return
        else:
            data = encode_residual(captured, recomputed)
        # an exact residual also keeps any bound: a tolerance never costs more than exact
        modelled = _rounding_residual(part, captured, cap, unrounded) if unrounded else None
        if modelled is not None and len(modelled) < len(data):
            data = modelled
        out.parts[f"residual.{part}"] = data
        out.residual_bytes += len(data)

    def screen_tokens(self, entry: dict, data: bytes | None, canon: CanonicalForward) -> None:
        """Refuse, before any model step, a stored token stream that cannot be `entry`'s.

        The default checks nothing: streams whose header records no length are bounded by
        the model context as they decode."""

    def decode(
        self, entry: dict, read: Callable[[str], bytes | None], canon: CanonicalForward
    ) -> Capture:
        [result] = self.decode_many([entry], [read], canon)
        if isinstance(result, Exception):
            raise result
        return result

    def decode_many(self, entries: list[dict], reads: list, canon: CanonicalForward) -> list:
        """Captures (or the error of each session that failed), decoded together."""
        from seqkv_codecs.errors import CodecError

        adapter = CanonicalLogits(canon)
        decoded = self.decode_tokens_many([read("tokens.seq") for read in reads], adapter)
        results = []
        for entry, read, (tokens, track) in zip(entries, reads, decoded, strict=True):
            try:
                if isinstance(tokens, Exception):
                    raise tokens
                results.append(self._restore(entry, read, tokens, track, adapter))
            except (SeqkvError, CodecError) as exc:
                results.append(exc)
        return results

    def _restore(self, entry, read, tokens, track, adapter) -> Capture:
        if len(tokens) != entry["positions"]:
            raise SeqkvError(
                f"session {entry['id']}: token stream holds {len(tokens)} tokens, "
                f"header says {entry['positions']}"
            )
        track = adapter.finish(track, tokens)
        keys, values = track.kv(adapter.canon.num_layers, DTYPES[entry["dtype"]])
        return finish_capture(
            entry, read, tokens, keys, values, track.surprisal, unrounded=track.unrounded
        )


def _rounding_residual(part: str, captured, cap, unrounded) -> bytes | None:
    """`part`'s residual modelled on the rounding of the recompute (None where it cannot be)."""
    from seqkv_codecs.rounding_residual import DTYPES as ROUNDED
    from seqkv_codecs.rounding_residual import encode_rounding_residual

    dtype = cap.meta["dtype"]
    _, layer, kind = part.split(".")
    exact = unrounded(kind, int(layer)).numpy() if dtype in ROUNDED else None
    if exact is None or exact.shape != captured.shape:
        return None
    return encode_rounding_residual(captured, exact, dtype)


def _no_recompute(layer: int, kind: str) -> SeqkvError:
    return SeqkvError(
        f"residual.layers.{layer}.{kind} is modelled on a recompute this session's codec "
        "does not make: the file is damaged"
    )


def finish_capture(
    entry: dict,
    read,
    tokens,
    keys,
    values,
    surprisal,
    deferred: dict | None = None,
    residuals: bool = True,
    unrounded=None,
) -> Capture:
    """Recomputed K/V plus the session's stored residuals (and surprisal, when stored).

    `residuals` False: K/V decoded directly (per-vector blocks), so there is no residual
    magnitude to report (`Capture.residual_p95` None).

    A residual resting on another session (`SKB1`, trie archives only) is left for the caller
    in `deferred` ({(kind, layer): (base local index, positions, SKR1/SKR2 stream, the
    unrounded recompute after those positions for SKR2, else None)}, also kept on
    the capture as `.deferred`); without `deferred` one is refused as damage. A residual
    modelled on rounding (`SKR2`) reads `unrounded(kind, layer)`, the recompute before it
    was rounded to the session's dtype."""
    from seqkv_codecs.errors import CodecError
    from seqkv_codecs.residual import BASED_MAGIC, apply_residual, parse_based
    from seqkv_codecs.rounding_residual import MAGIC as ROUNDING_MAGIC
    from seqkv_codecs.rounding_residual import apply_rounding_residual
    from seqkv_codecs.tolerance import MAGIC as TOLERANCE_MAGIC
    from seqkv_codecs.tolerance import apply_tolerance

    dtype = DTYPES[entry["dtype"]]
    p95 = {"key": [0.0] * len(keys), "value": [0.0] * len(values)}
    for kind, tensors in (("key", keys), ("value", values)):
        for layer, t in enumerate(tensors):
            data = read(f"residual.layers.{layer}.{kind}")
            if data is None:
                continue
            if data[:4] == BASED_MAGIC:
                if deferred is None:
                    raise SeqkvError(
                        f"residual.layers.{layer}.{kind} rests on another session, which only "
                        "a trie archive's sessions may do: the file is damaged"
                    )
                try:
                    base, positions, inner = parse_based(data)
                except CodecError as exc:
                    raise SeqkvError(f"residual.layers.{layer}.{kind}: {exc}") from None
                tail = None  # an SKR2 inner stream reads the recompute after the shared part
                if inner[:4] == ROUNDING_MAGIC:
                    if unrounded is None:
                        raise _no_recompute(layer, kind)
                    tail = unrounded(kind, layer)[:, positions:].clone()
                deferred[(kind, layer)] = (base, positions, inner, tail)
                continue
            if data[:4] == TOLERANCE_MAGIC:
                bits = apply_tolerance(data, kv_bits(t), entry["dtype"])
            elif data[:4] == ROUNDING_MAGIC:
                if unrounded is None:
                    raise _no_recompute(layer, kind)
                bits = apply_rounding_residual(data, unrounded(kind, layer).numpy(), entry["dtype"])
            else:
                bits = apply_residual(data, kv_bits(t))
            tensors[layer] = kv_from_bits(bits, dtype)
            p95[kind][layer] = residual_p95(t, tensors[layer])
    stored = read("surprisal")
    if stored is not None:
        surprisal = decode_surprisal_part(stored, surprisal)
    meta = {"session_id": entry["id"], "dtype": entry["dtype"]}  # Archive completes it
    cap = Capture(torch.from_numpy(np.asarray(tokens)), keys, values, surprisal, meta)
    cap.residual_p95 = p95 if residuals else None
    if deferred:
        cap.deferred = deferred
    return cap
