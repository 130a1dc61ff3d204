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
from seqkv_cli.runtime.portable.weights import QuantizedWeight


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two fp32 tensors hold the same bits (NaNs included)."""
    return a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.int32), b.contiguous().view(torch.int32)
    )


# A fixed input grid through every primitive; its digest is a constant of the definition.
CANARY_DIGEST = "295fe8e6e55106331bbb0b4c6c61d3d8d408b756a0f680d34f1c19850e3cdfd4"


def canary_digest(device=None) -> str:
    """The digest of the primitives computed on `device` (default: the CPU)."""
    i = torch.arange(4096, dtype=torch.int64, device=device or "cpu")
    # Built from integers by one correctly rounded division: the same grid everywhere.
    rows = ((i * 7919 % 4001 - 2000).to(torch.float64) / 97.0).float().view(64, 64)
    parts = [
        elementary.exp(rows),
        elementary.log(rows.abs() + 1e-3),
        elementary.sin(rows * 300.0),
        elementary.cos(rows * 300.0),
        elementary.tanh(rows),
        elementary.silu(rows),
        elementary.gelu_tanh(rows),
        elementary.softmax(rows, -1),
        elementary.log_softmax(rows, -1),
        elementary.tree_sum(rows, -1),
        elementary.rsqrt(rows.abs() + 1.0),
        exact.matmul(rows, rows.t().contiguous()).float(),
        exact.matmul(rows, rows.t().contiguous(), exact.PEAK2),  # fp64: both integers' sum
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


def kernels_agree() -> bool:
    """Whether the native kernels the digest does not reach give the reference's bits here:
    integer products over split weights at the 2**53 bound (every step's linears) and the
    attention between its products (every step's softmax). Fixed inputs, like the digest's."""
    i = torch.arange(4 * 1536, dtype=torch.int64)
    x = ((i * 7919 % 4001 - 2000).to(torch.float64) / 97.0).float().view(4, 1536)
    w = ((i * 104729 % 3001 - 1500).to(torch.float64) / 13.0).float().view(4, 1536)
    w = torch.cat([w, w.flip(-1), -w, w * 1e-3]).repeat(8, 1)  # (128, 1536), row peaks differ
    forms = (exact.PEAK1, exact.PEAK2, exact.L1)
    cases = [(n, form, exact.right_bits(1536, form)) for n in (1, 3) for form in forms]
    got = [QuantizedWeight.of(w, bits).product(x[:n], bits, form) for n, form, bits in cases]
    heads, n = 2, 40
    steps = {True: [], False: []}
    for native in (True, False):
        with contextlib.nullcontext() if native else kernels.reference():
            for bits, form in (((23, 19, 40), exact.PEAK2), ((23, 23, 40), exact.L1)):
                state = PortableState(1, heads, 64, n, bits, form=form)
                k = x.view(-1)[: heads * n * 64].view(heads, n, 64)
                state.write(0, k, k.flip(-1) * 0.5)
                state.length = n - 1
                q = x.view(-1)[-4 * 64 :].view(4, 1, 64)  # 4 query heads over 2 KV heads, a step
                steps[native].append(attend(state, 0, q, 0.125, None, None))
            if not native:
                want = [
                    exact.fixed_product(x[:m], bits, *exact.quantize_rows(w, bits), form)
                    for m, form, bits in cases
                ]
    pairs = zip([*got, *steps[True]], [*want, *steps[False]], strict=True)
    return all(same_bits(a, b) for a, b in pairs)


def run_canary(device=None) -> None:
    """Refuse, with the check named, where this machine (or device) does not reproduce the
    definition."""
    where = str(device or "cpu")
    if where not in _canary_ok:
        _canary_ok[where] = canary_digest(device) == CANARY_DIGEST
        if _canary_ok[where] and where == "cpu" and kernels.enabled() and not kernels_agree():
            raise SeqkvError(
                "portable numerics: a native kernel gives other bits than the reference on this "
                f"machine; set {kernels.ENV}=reference to code and decode without the kernels"
            )
    if not _canary_ok[where]:
        on = "" if where == "cpu" else f" on {where}"
        raise SeqkvError(
            f"portable numerics canary failed{on}: this machine's floating point does not "
            f"reproduce the portable ({', '.join(exact.FORMS)}) primitives (flush-to-zero or "
            "fused operations?); "
            "files written on the portable path cannot be coded or decoded here"
        )
