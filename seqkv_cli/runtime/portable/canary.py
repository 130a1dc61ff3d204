"""The canary: does this machine (or device) reproduce the portable definition's bits?

A fixed input grid through every primitive hashes to a constant of the definition; on the
CPU the native kernels the digest does not reach are checked against the reference too.
`PortableLM` runs it once per device before first use and refuses, naming the check.
"""

from __future__ import annotations

import contextlib
import hashlib

import torch

from seqkv_cli.errors import SeqkvError
from seqkv_cli.runtime.portable import elementary, exact, kernels
from seqkv_cli.runtime.portable.attention import PortableState, attend


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two fp32 tensors hold the same bits (NaNs included)."""
    return a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.int32), b.contiguous().view(torch.int32)
    )


# A fixed input grid through every primitive; its digest is a constant of the definition.
CANARY_DIGEST = "572b1d43c319029097224949f7c7ce5caba640106f329a7ef11f461d5af9b03c"


def canary_digest(device=None) -> str:
    """The digest of the primitives computed on `device` (default: the CPU)."""
    i = torch.arange(4096, dtype=torch.int64, device=device or "cpu")
    # Built from integers by one correctly rounded division: the same grid everywhere.
    rows = ((i * 7919 % 4001 - 2000).to(torch.float64) / 97.0).float().view(64, 64)
    # v2's two-limb product by the reference alone: its kernels are checked where a v2 file
    # is read (`run_canary` with that form), and a v3 run then compiles none of them.
    with kernels.reference():
        two_limbs = exact.matmul(rows, rows.t().contiguous(), exact.PEAK2)  # fp64
    parts = [
        elementary.exp(rows),
        elementary.log(rows.abs() + 1e-3),
        elementary.sin(rows * 300.0),
        elementary.cos(rows * 300.0),
        elementary.tanh(rows),
        elementary.silu(rows),
        elementary.gelu_tanh(rows),
        elementary.gelu_erf(rows),
        elementary.softmax(rows, -1),
        elementary.log_softmax(rows, -1),
        elementary.tree_sum(rows, -1),
        elementary.rsqrt(rows.abs() + 1.0),
        exact.matmul(rows, rows.t().contiguous()).float(),
        two_limbs,
        exact.matmul(rows * rows.abs(), rows.t().contiguous(), exact.L1),  # L1-scaled rows
        elementary.power(
            10000.0,
            torch.arange(0, 64, 2, dtype=torch.float32, device=i.device) / 64,
            torch.float32,
        ),
    ]
    h = hashlib.sha256()
    for p in parts:
        h.update(p.contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


_canary_ok: dict[str, bool] = {}  # per device: a GPU is checked on its own kernels


def _fixed_stored(kind: str, rows: int, k: int):
    """A `StoredTensor` of ``kind`` with fixed contents: bytes from integers (every machine
    makes the same), fp16 block scales kept finite and spread over many binades."""
    import numpy as np

    from seqkv_cli.runtime.checkpoint import KINDS, StoredTensor
    from seqkv_cli.runtime.checkpoint.formats import stored_array

    spec = KINDS[kind]
    i = np.arange(rows * spec.row_bytes(k), dtype=np.int64)
    raw = ((i * 7919 + (i >> 7) * 104729) % 251).astype(np.uint8).reshape(rows, -1)
    blocks = raw.reshape(-1, spec.block_bytes)
    for at in spec.halves:  # exponent field below 31: finite scales of either sign
        blocks[:, at + 1] &= 0xBF
    if kind == "f32":
        raw = ((i[: rows * k] % 4001 - 2000) / 97.0).astype(np.float32).reshape(rows, k)
    elif kind in ("f16", "bf16"):
        raw = raw.view(np.uint16) & 0x3FFF  # finite, positive and negative exponents both
        raw = raw | ((np.arange(raw.size).reshape(raw.shape) % 2) << 15).astype(np.uint16)
    return StoredTensor(KINDS[kind], stored_array(KINDS[kind], raw), (rows, k))


STEP_ROWS, TILE_ROWS = (1, 3), (2 * kernels.MAX_KERNEL_ROWS,)
# The attention's state bits and product form, for the forms a model's file may use (v2, v3).
ATTENTION_CASES = (((23, 19, 40), exact.PEAK2), ((23, 23, 40), exact.L1))


def _attention_cases(forms: tuple[int, ...]) -> tuple:
    """The attention cases of ``forms`` (all of them where none is an attention form): a
    model checks only the form its file uses, so a v3 capture compiles no v2 kernel."""
    return tuple(c for c in ATTENTION_CASES if c[1] in forms) or ATTENTION_CASES


def kernels_agree(
    kinds: tuple[str, ...] = ("f32",),
    forms: tuple[int, ...] = (exact.PEAK1, exact.PEAK2, exact.L1),
    rows: tuple[int, ...] = STEP_ROWS + TILE_ROWS,
    attention: bool = True,
) -> bool:
    """Whether the native kernels the digest does not reach give the reference's bits here:
    every product over stored weights of ``kinds`` in ``forms`` with ``rows`` rows (1 and 3:
    a step's kernels at the 2**53 bound; more: a prefill's tiles), the decoders and (with
    `attention`) the attention between the products (every step's softmax). Fixed inputs,
    like the digest's. Only the kernels a model will run are compiled and checked (their
    compiling is most of a first run's wait)."""
    from seqkv_cli.runtime.checkpoint import WeightStore
    from seqkv_cli.runtime.portable.weights import StoredRows, WeightCache

    i = torch.arange(4 * 1536, dtype=torch.int64)
    x = ((i * 7919 % 4001 - 2000).to(torch.float64) / 97.0).float().view(4, 1536)
    cases = [(n, form, exact.right_bits(1536, form)) for n in rows for form in forms]
    xs = x.repeat(kernels.MAX_KERNEL_ROWS, 1)  # more rows than a step: the tiled product
    agree = True
    for kind in sorted(set(kinds)):
        stored = _fixed_stored(kind, 64, 1536)
        cache = WeightCache(torch.nn.Module(), WeightStore())
        got = [StoredRows([stored], cache).product(xs[:n], bits, form) for n, form, bits in cases]
        with kernels.reference():
            values = stored.fp32_rows()
            want = [
                exact.fixed_product(xs[:n], bits, *exact.quantize_rows(values, bits), form)
                for n, form, bits in cases
            ]
        agree &= all(same_bits(a, b) for a, b in zip(got, want, strict=True))
        agree &= same_bits(stored.fp32_rows(), values)
    if not attention:
        return agree
    heads, n = 2, 40
    steps = {True: [], False: []}
    for native in (True, False):
        with contextlib.nullcontext() if native else kernels.reference():
            for bits, form in _attention_cases(forms):
                state = PortableState(1, heads, 64, n, bits, form=form)
                k = x.view(-1)[: heads * n * 64].view(heads, n, 64)
                state.write(0, k, k.flip(-1) * 0.5)
                state.length = n - 1
                q = x.view(-1)[-4 * 64 :].view(4, 1, 64)  # 4 query heads over 2 KV heads, a step
                steps[native].append(attend(state, 0, q, 0.125, None, None))
    return agree and all(same_bits(a, b) for a, b in zip(steps[True], steps[False], strict=True))


_kinds_ok: set[tuple[str, int]] = set()  # (stored kind, form) pairs checked here (tiles)
_steps_ok: set[tuple[str, int]] = set()  # the same for a step's kernels


def _kernel_mismatch() -> SeqkvError:
    return SeqkvError(
        "portable numerics: a native kernel gives other bits than the reference on this "
        f"machine; set {kernels.ENV}=reference to code and decode without the kernels"
    )


def run_canary(device=None, kinds: tuple[str, ...] = ("f32",), form: int = exact.L1) -> None:
    """Refuse, with the check named, where this machine (or device) does not reproduce the
    definition; on the CPU, also where a native kernel for weights stored as one of ``kinds``
    in the product form ``form`` (a prefill's tiles, the attention's) gives other bits than
    the reference. A step's kernels (its products, its attention of few rows) are checked
    when first used (`check_step`): a capture, a prefill, never compiles them."""
    where = str(device or "cpu")
    if where not in _canary_ok:
        _canary_ok[where] = canary_digest(device) == CANARY_DIGEST
    unchecked = tuple(k for k in kinds if (k, form) not in _kinds_ok)
    if _canary_ok[where] and where == "cpu" and kernels.enabled() and unchecked:
        with kernels.tiles_only():  # the attention as a prefill runs it (steps: check_step)
            agree = kernels_agree(unchecked, (form,), TILE_ROWS)
        if not agree:
            raise _kernel_mismatch()
        _kinds_ok.update((k, form) for k in unchecked)
    if not _canary_ok[where]:
        on = "" if where == "cpu" else f" on {where}"
        raise SeqkvError(
            f"portable numerics canary failed{on}: this machine's floating point does not "
            f"reproduce the portable ({', '.join(exact.FORMS)}) primitives (flush-to-zero or "
            "fused operations?); "
            "files written on the portable path cannot be coded or decoded here"
        )


def check_step(kind: str, form: int) -> None:
    """Before a step's native product over weights stored as `kind` in `form` first runs in
    this process: refuse where it, or a step's attention, gives other bits than the
    reference here."""
    if (kind, form) in _steps_ok:
        return
    _steps_ok.add((kind, form))  # the check's own products run the kernels it checks
    try:
        agree = kernels_agree((kind,), (form,), STEP_ROWS)  # and a step's attention
    except BaseException:
        _steps_ok.discard((kind, form))
        raise
    if not agree:
        _steps_ok.discard((kind, form))
        raise _kernel_mismatch()
