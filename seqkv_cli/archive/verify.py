"""One check of a restored session against its capture, for every command that verifies.

What must hold: the same tokens and surprisal, the same number of layers, and every K/V
tensor of the same shape and dtype. Then what the codec promises: lossless codecs every bit;
a codec with a `tolerance` (seq with --tolerance) max |restored - captured| <= tolerance.
Per-vector lossy codecs document no bound: their error is measured (`verify --against`,
`report`), not judged.

`check_sessions` decodes sessions of an open archive and checks each against its capture
(`seqkv verify --against`, `seqkv pipeline`); the commands only format what it returns.
The measures themselves (`compare`, `attention_error`) are shared with `seqkv report`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from seqkv_cli.errors import SeqkvError

if TYPE_CHECKING:
    from seqkv_cli.archive.restore import Archive
    from seqkv_cli.kvcapture.capture_file import Capture
    from seqkv_cli.sequential.session_codec import SessionCodec
    from seqkv_codecs.base import Codec

PROBE_QUERIES = 16
PROBE_SEED = 0


@dataclass
class LayerFidelity:
    layer: int
    kind: str
    exact: bool
    max_abs: float
    rel_l2: float


def compare(original: torch.Tensor, restored: torch.Tensor, layer: int, kind: str):
    # Compare bits, not values: NaN == NaN and -0.0 != 0.0 for a lossless promise.
    exact = original.dtype == restored.dtype and torch.equal(
        original.contiguous().view(torch.uint8), restored.contiguous().view(torch.uint8)
    )
    a, b = original.float(), restored.float()
    diff = (a - b).nan_to_num(nan=float("inf"))
    max_abs = float(diff.abs().max()) if diff.numel() else 0.0
    rel = float(diff.norm() / a.norm().clamp_min(1e-30)) if diff.numel() else 0.0
    return LayerFidelity(layer, kind, bool(exact), max_abs, rel)


def attention_error(
    keys: torch.Tensor, values: torch.Tensor, keys_hat: torch.Tensor, values_hat: torch.Tensor
) -> float:
    """Relative L2 error of softmax(q K^T / sqrt(d)) V under a fixed random query probe.

    Captures hold no queries, so a seeded Gaussian probe (same for every file) stands in:
    it weighs errors by how attention would actually mix the values.
    """
    gen = torch.Generator().manual_seed(PROBE_SEED)
    num, den = 0.0, 0.0
    for k, v, kh, vh in zip(keys, values, keys_hat, values_hat, strict=True):
        heads, _, dim = k.shape
        q = torch.randn(heads, PROBE_QUERIES, dim, generator=gen) * (dim**-0.25) * 4
        ref = torch.softmax(q @ k.float().transpose(1, 2) / dim**0.5, -1) @ v.float()
        out = torch.softmax(q @ kh.float().transpose(1, 2) / dim**0.5, -1) @ vh.float()
        num += float((ref - out).pow(2).sum())
        den += float(ref.pow(2).sum())
    return (num / den) ** 0.5 if den else 0.0


VERIFY_MODES = ("all", "sample", "none")
SAMPLE_SESSIONS = 2  # `--verify sample` decodes this many sessions, the shortest ones


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes: NaN == NaN and -0.0 != 0.0, as a lossless promise needs."""
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


def restored_problems(
    original: Capture, restored: Capture, codec: SessionCodec | Codec
) -> list[str]:
    """What differs between `restored` and `original` beyond what `codec` allows; [] if none."""
    problems = structure_problems(original, restored)
    if problems:
        return problems  # tensors of other shapes cannot be compared element by element
    return _promise_problems(original, restored, codec)


def _promise_problems(original, restored, codec) -> list[str]:
    """What breaks the codec's promise, for a restored session of the original's structure."""
    problems = []
    if codec.lossless:
        if not same_capture(original, restored):
            err = max_abs_error(original, restored)
            problems.append(f"not bit-exact (max abs error {err:.3g})")
        return problems
    eps = getattr(codec, "tolerance", None)
    if eps is not None:
        err = max_abs_error(original, restored)
        if not err <= eps:  # NaN fails too
            problems.append(f"max abs error {err:.3g} above the tolerance {eps:g}")
    return problems


def check_restored(
    original: Capture, restored: Capture, codec: SessionCodec | Codec, consequence: str = ""
) -> None:
    """Raise one SeqkvError naming the session and what differs (see `restored_problems`)."""
    problems = restored_problems(original, restored, codec)
    if problems:
        tail = f"; {consequence}" if consequence else ""
        raise SeqkvError(
            f"session {original.session_id} did not round-trip through {codec.codec_id}: "
            f"{'; '.join(problems)}{tail}"
        )


def same_capture(a: Capture, b: Capture) -> bool:
    """Tokens, surprisal and every K/V tensor equal bit for bit."""
    if len(a.keys) != len(b.keys) or len(a.values) != len(b.values):
        return False
    pairs = [
        (a.tokens, b.tokens),
        (a.surprisal.double(), b.surprisal.double()),
        *zip(a.keys, b.keys, strict=True),
        *zip(a.values, b.values, strict=True),
    ]
    return all(bit_equal(x, y) for x, y in pairs)


def max_abs_error(a: Capture, b: Capture) -> float:
    """Largest |restored - captured| over every K/V element (NaN if any difference is NaN)."""
    pairs = [*zip(a.keys, b.keys, strict=True), *zip(a.values, b.values, strict=True)]
    errors = [float((x.double() - y.double()).abs().max()) for x, y in pairs if x.numel()]
    if any(e != e for e in errors):
        return float("nan")
    return max(errors, default=0.0)


def structure_problems(original: Capture, restored: Capture) -> list[str]:
    """Tokens, surprisal, layer count, shapes and dtypes: what every codec must give back."""
    problems = []
    tokens, other = original.tokens.to(torch.long), restored.tokens.to(torch.long)
    if tokens.shape != other.shape:
        problems.append(f"{other.numel()} tokens instead of {tokens.numel()}")
    elif not torch.equal(tokens, other):
        first = int((tokens != other).nonzero()[0, 0]) if tokens.dim() == 1 else 0
        problems.append(f"tokens differ (first at position {first})")
    surprisal, got = original.surprisal.double(), restored.surprisal.double()
    if surprisal.shape != got.shape or not torch.equal(surprisal, got):
        problems.append("surprisal differs")
    return problems + kv_structure_problems(original, restored)


def kv_structure_problems(original: Capture, restored: Capture) -> list[str]:
    """Layer count, then every K/V tensor's shape and dtype."""
    problems = []
    if len(original.keys) != len(restored.keys) or len(original.values) != len(restored.values):
        problems.append(
            f"{len(restored.keys)}/{len(restored.values)} K/V layers instead of "
            f"{len(original.keys)}/{len(original.values)}"
        )
        return problems
    kinds = (("key", original.keys, restored.keys), ("value", original.values, restored.values))
    for kind, xs, ys in kinds:
        for layer, (x, y) in enumerate(zip(xs, ys, strict=True)):
            where = f"layer {layer} {kind}"
            if x.shape != y.shape:
                problems.append(f"{where} shape {tuple(y.shape)} instead of {tuple(x.shape)}")
            elif x.dtype != y.dtype:
                problems.append(f"{where} dtype {y.dtype} instead of {x.dtype}")
    return problems


# -- decoding and checking the sessions of an archive ----------------------------------------


@dataclass(frozen=True)
class SessionCheck:
    """One session of an archive, decoded and checked against its capture.

    ``compared`` is False for a session no original was given for (nothing else is set).
    ``problems``: what breaks the codec's promise (`restored_problems`); empty when it holds.
    ``errors``: per layer, keys then values, exactness and error (`fidelity.compare`); None
    where the structure differs (no element-by-element comparison) or errors were not measured.
    """

    session_id: str
    compared: bool = True
    problems: tuple[str, ...] = ()
    errors: tuple[LayerFidelity, ...] | None = None
    attention_error: float | None = None

    @property
    def ok(self) -> bool:
        """The codec's promise holds (or there was nothing to compare with)."""
        return not self.problems

    @property
    def exact(self) -> bool:
        """Every measured K/V tensor is bit-exact (False where errors were not measured)."""
        return self.errors is not None and all(e.exact for e in self.errors)

    @property
    def max_abs(self) -> float | None:
        """Largest absolute error over the measured layers, or None."""
        return None if self.errors is None else max(e.max_abs for e in self.errors)

    @property
    def rel_l2(self) -> float | None:
        """Largest relative L2 error over the measured layers, or None."""
        return None if self.errors is None else max(e.rel_l2 for e in self.errors)


def layer_errors(original: Capture, restored: Capture) -> list[LayerFidelity]:
    """`fidelity.compare` of every layer's keys, then every layer's values (same structure)."""
    return [
        compare(a, b, i, kind)
        for kind, xs, ys in (
            ("key", original.keys, restored.keys),
            ("value", original.values, restored.values),
        )
        for i, (a, b) in enumerate(zip(xs, ys, strict=True))
    ]


def check_session(
    original: Capture, restored: Capture, codec: SessionCodec | Codec, *, measure: bool = True
) -> SessionCheck:
    """Check one restored session: the codec's promise and, with `measure`, its errors."""
    structure = structure_problems(original, restored)
    problems = structure or _promise_problems(original, restored, codec)
    errors = attn = None
    if measure and not structure:
        errors = tuple(layer_errors(original, restored))
        attn = attention_error(original.keys, original.values, restored.keys, restored.values)
    return SessionCheck(original.session_id, True, tuple(problems), errors, attn)


def check_verify_mode(mode: str) -> str:
    """Refuse a `--verify` mode other than all, sample or none."""
    if mode not in VERIFY_MODES:
        raise SeqkvError(f"--verify must be one of {', '.join(VERIFY_MODES)}, not '{mode}'")
    return mode


def sessions_to_decode(entries: list[dict], mode: str) -> list[dict]:
    """The session entries a `--verify` mode decodes: all or the shortest few, by length."""
    if check_verify_mode(mode) == "none":
        return []
    ordered = sorted(entries, key=lambda e: e["positions"])
    return ordered if mode == "all" else ordered[:SAMPLE_SESSIONS]


def check_sessions(
    arc: Archive,
    originals: Mapping[str, object],
    entries: list[dict] | None = None,
    *,
    measure: bool = True,
) -> list[SessionCheck]:
    """Decode `entries` (default: every session) of an open `Archive`; check each one.

    ``originals`` maps session ids to captures; a session without one is decoded (so every
    block is read) but not compared. An original naming a session the archive lacks is refused
    before anything decodes, and a session that fails to decode raises its error.
    """
    known = {e["id"] for e in arc.sessions}
    missing = set(originals) - known
    if missing:
        raise SeqkvError(f"{arc.path} holds no session {sorted(missing)[0]!r} to compare with")
    checks = []
    for entry, restored in arc.restore_many(arc.sessions if entries is None else entries):
        if isinstance(restored, Exception):
            raise restored
        original = originals.get(entry["id"])
        if original is None:
            checks.append(SessionCheck(entry["id"], compared=False))
        else:
            checks.append(check_session(original, restored, arc.codec, measure=measure))
    return checks


def check_added(path, model, source, coder) -> None:
    """One session just added to the archive at `path` restores as given (its tokens; its
    K/V where it stored a capture), else one line (it is stored anyway)."""
    from seqkv_cli.archive.restore import Archive

    with Archive(path, model=model) as arc:
        restored = arc.restore(arc.session(source.session_id))
    if source.recompute:  # tokens only: K/V are the canonical recompute by definition
        if not np.array_equal(restored.tokens.numpy(), source.tokens):
            raise SeqkvError(
                f"session {source.session_id} restores other tokens than it was given; "
                f"stored in {path} anyway"
            )
        return
    check_restored(source.capture, restored, coder, f"stored in {path} anyway")
