"""One check of a restored session against its capture, for every command that verifies.

What must hold: the same tokens and surprisal, the same number of layers, and every K/V
tensor of the same shape and dtype. Then what the codec promises: lossless codecs every bit;
a codec with a `tolerance` (seq with --tolerance) max |restored - captured| <= tolerance.
Per-vector lossy codecs document no bound: their error is measured (`verify --against`,
`report`), not judged.
"""

from __future__ import annotations

import torch

from seqkv_cli.errors import SeqkvError


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes: NaN == NaN and -0.0 != 0.0, as a lossless promise needs."""
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


def restored_problems(original, restored, codec) -> list[str]:
    """What differs between `restored` and `original` beyond what `codec` allows; [] if none."""
    problems = structure_problems(original, restored)
    if problems:
        return problems  # tensors of other shapes cannot be compared element by element
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


def check_restored(original, restored, codec, consequence: str = "") -> None:
    """Raise one SeqkvError naming the session and what differs (see `restored_problems`)."""
    problems = restored_problems(original, restored, codec)
    if problems:
        tail = f"; {consequence}" if consequence else ""
        raise SeqkvError(
            f"session {original.session_id} did not round-trip through {codec.codec_id}: "
            f"{'; '.join(problems)}{tail}"
        )


def same_capture(a, b) -> bool:
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


def max_abs_error(a, b) -> float:
    """Largest |restored - captured| over every K/V element (NaN if any difference is NaN)."""
    pairs = [*zip(a.keys, b.keys, strict=True), *zip(a.values, b.values, strict=True)]
    errors = [float((x.double() - y.double()).abs().max()) for x, y in pairs if x.numel()]
    if any(e != e for e in errors):
        return float("nan")
    return max(errors, default=0.0)


def structure_problems(original, restored) -> list[str]:
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


def kv_structure_problems(original, restored) -> list[str]:
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
