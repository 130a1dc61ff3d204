"""Attention in the portable definition, registered with transformers' AttentionInterface.

Scores are fixed-point products of per-row quantized queries and keys (exact); the softmax
numerators are fixed-point with 2**-(53 - log2 context) resolution (2**-40 at 8k), so their
sum is exact in any order; the
value product folds each key's power-of-two scale into its weight and quantizes the weights
per query row, so it is exact too. Queries and weights take the definition's left form (v3:
scaled by their row's L1 norm, against keys and values of `exact.L1_KV_BITS`). Bit widths come
from the head size and the model context, never from how many keys a call happens to see (a
masked key adds nothing to a row's peak or L1 norm): a query gets the same bits whether later
keys exist (prefill) or not (stepping). Masking (causal, sliding window) is computed from absolute
positions; soft-capping uses the portable tanh.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math

import torch
from torch.utils._python_dispatch import _disable_current_modes

from seqkv_cli.errors import SeqkvError
from seqkv_cli.runtime.portable import elementary, exact, kernels

ATTENTION_NAME = "seqkv_portable"
QUERY_BLOCK = 128  # query rows per pass: bounds the (rows x keys) score matrix
# Query rows per KV head up to which one native pass does the whole block, products included
# (a step, or a few guessed tokens); more rows are faster through the fp64 BLAS.
STEP_ROWS = 16

# The keyword under which a PortableLM forward hands its sequences (one per batch row) to the
# registered attention: transformers passes a forward's extra keywords down to it.
ROWS_KWARG = "seqkv_rows"
# The same states for the call's duration, for families whose decoder layers do not pass
# attention keyword arguments down (StableLM, Falcon, Nemotron): `rows_of_call`.
_CALL_ROWS: contextvars.ContextVar[list | None] = contextvars.ContextVar("seqkv_rows", default=None)


@contextlib.contextmanager
def rows_of_call(states: list):
    """Within it, seqkv's attention finds `states` even where a layer dropped the keyword."""
    token = _CALL_ROWS.set(states)
    try:
        yield
    finally:
        _CALL_ROWS.reset(token)


def integer_dtype(bits: tuple[int, ...]) -> torch.dtype:
    """How a state holds its key and value integers of ``bits`` (keys, values, ...): fp32
    where every one of them is exact there, else fp64."""
    return torch.float32 if max(bits[:2]) <= exact.FP32_INTEGER_BITS else torch.float64


def state_layout(num_layers, kv_heads, head_dim, capacity, bits) -> dict[str, tuple]:
    """A `PortableState`'s tensors, name -> (shape, dtype): what it allocates, and what
    `seqkv model info` counts (runtime/footprint)."""
    rows = (num_layers, kv_heads, capacity)
    held = integer_dtype(bits)
    return {
        "keys": ((*rows, head_dim), torch.float32),
        "values": ((*rows, head_dim), torch.float32),
        "kq": ((*rows, head_dim), held),
        "vq": ((*rows, head_dim), held),
        "ek": ((*rows, 1), torch.int64),
        "ev": ((*rows, 1), torch.int64),
    }


class PortableState:
    """Preallocated K/V of one sequence, with the quantized rows attention multiplies.

    keys/values (layers, kv_heads, capacity, head_dim) hold what the model produced (fp32);
    ``kq``/``vq`` the same rows as integers with their power-of-two exponents ``ek``/``ev``.
    The integers are held in fp32 where their width lets every one be exact there (the
    products read them as fp64, the same values): half the bytes of an fp64 copy, which is
    what a long session's memory is made of.
    """

    def __init__(
        self,
        num_layers,
        kv_heads,
        head_dim,
        capacity,
        bits: tuple[int, int, int],
        device=None,
        form: int = exact.PEAK1,
    ):
        on = {"device": device or "cpu"}
        self._layout = state_layout(num_layers, kv_heads, head_dim, capacity, bits)
        for name, (shape, dtype) in self._layout.items():
            setattr(self, name, torch.zeros(shape, dtype=dtype, **on))
        # Fixed by the model (head size, context), never by this state's capacity.
        self.bits = bits
        self.key_bits, self.value_bits, self.prob_bits = bits
        self.form = form  # queries' and softmax weights' form (the definition's version)
        self.capacity = capacity
        self.length = 0
        self._arrays = None  # `arrays()`

    def arrays(self) -> tuple:
        """numpy views of (keys, values, kq, ek, vq, ev), made once: a step's native kernels
        read and write the cache through them (CPU states only)."""
        if self._arrays is None:
            self._arrays = tuple(
                getattr(self, n).numpy() for n in ("keys", "values", "kq", "ek", "vq", "ev")
            )
        return self._arrays

    def layer_kv(self, layer: int, n: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer's first ``n`` positions (default: all), (kv_heads, n, head_dim),
        on the CPU (views of the state there; copies from a GPU state)."""
        n = self.length if n is None else n
        return self.keys[layer, :, :n].cpu(), self.values[layer, :, :n].cpu()

    def integers(self, layer: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's key and value integers of the first ``n`` positions as fp64 (what the
        BLAS products multiply; a copy where they are held in fp32)."""
        return exact.f64(self.kq[layer, :, :n]), exact.f64(self.vq[layer, :, :n])

    def fork(self, length: int, capacity: int) -> PortableState:
        """A new state holding this one's first ``length`` positions (a trie branch point)."""
        if length > self.length:
            raise SeqkvError(f"cannot fork at {length}: the state holds {self.length} positions")
        layers, heads, _, hd = self.keys.shape
        out = PortableState(layers, heads, hd, capacity, self.bits, self.keys.device, self.form)
        for name in self._layout:
            getattr(out, name)[:, :, :length] = getattr(self, name)[:, :, :length]
        out.length = length
        return out

    def crop(self, tokens: int) -> None:
        """Forget the last ``-tokens`` positions (transformers' `Cache.crop` convention: a
        negative count removes that many); their K/V rows are overwritten by the next call."""
        if tokens > 0 or -tokens > self.length:
            raise ValueError(f"cannot crop {tokens} positions from a state of {self.length}")
        self.length += tokens

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the call's new rows (kv_heads, n, head_dim) at positions length..length+n."""
        p0, n = self.length, k.shape[1]
        self.keys[layer, :, p0 : p0 + n] = k
        self.values[layer, :, p0 : p0 + n] = v
        kq, ek = exact.quantize_rows(k, self.key_bits)
        vq, ev = exact.quantize_rows(v, self.value_bits)
        self.kq[layer, :, p0 : p0 + n], self.ek[layer, :, p0 : p0 + n] = kq, ek
        self.vq[layer, :, p0 : p0 + n], self.ev[layer, :, p0 : p0 + n] = vq, ev


def portable_attention(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
):
    """transformers attention signature; query (batch, heads, q_len, head_dim)."""
    if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
        raise SeqkvError("portable numerics: attention sinks are not supported")
    rows = kwargs.get(ROWS_KWARG)
    if rows is None:
        rows = _CALL_ROWS.get()
    if rows is None:
        raise SeqkvError(
            f"portable numerics: {type(module).__name__} was called outside a PortableLM "
            "forward; compress with --codec lossless or a per-vector codec"
        )
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    with _disable_current_modes():
        outs = [
            attend(state, module.layer_idx, query[row], scaling, sliding_window, softcap)
            for row, state in enumerate(rows)
        ]
        out = torch.stack(outs).to(query.dtype)  # (batch, q_len, heads, head_dim)
    return out, None


def attend(state, layer, q, scaling, window, softcap) -> torch.Tensor:
    """One sequence: q (heads, m, hd) at positions length..length+m; returns (m, heads, hd)."""
    heads, m, hd = q.shape
    kvh = state.keys.shape[1]
    groups = heads // kvh
    p0 = state.length
    n = p0 + m
    qg = q.float().reshape(kvh, groups, m, hd).reshape(kvh, groups * m, hd)
    ek, ev = state.ek[layer, :, :n], state.ev[layer, :, :n]
    kq = vq = None  # the integers as fp64, made once by the first block that multiplies them
    on = {"device": q.device}
    key_pos = torch.arange(n, **on)
    parts = []
    for s in range(0, m, QUERY_BLOCK):
        end = min(m, s + QUERY_BLOCK)
        rows = torch.arange(s, end, **on)
        sel = (torch.arange(groups, **on)[:, None] * m + rows[None, :]).reshape(-1)
        qpos = (p0 + rows).repeat(groups)
        few = groups * len(rows) <= STEP_ROWS and kernels.steps_allowed()
        if softcap is None and kernels.usable(q) and few:
            block = kernels.attend_rows(
                exact.f64(qg[:, sel]), state, layer, p0 + end, qpos, window, scaling,
                elementary.EXP_KERNEL,
            )  # fmt: skip
            parts.append(block.view(kvh, groups, len(rows), hd))
            continue
        if softcap is None and kernels.usable(q):
            # Keys past the block's last row are masked for all of it: their numerators are
            # 0, so leaving them out changes no sum, maximum or exponent (the same bits).
            kq, vq = (kq, vq) if kq is not None else state.integers(layer, n)
            keys = [t[:, : p0 + end] for t in (kq, ek, vq, ev)]
            acc, total = _scores_to_values(state, qg[:, sel], *keys, qpos, scaling, window)
            parts.append((acc / total).view(kvh, groups, len(rows), hd))
            continue
        kq, vq = (kq, vq) if kq is not None else state.integers(layer, n)
        scores = exact.fixed_product(qg[:, sel], state.key_bits, kq, ek, state.form) * scaling
        if softcap is not None:
            scores = elementary.tanh(scores / softcap) * softcap
        visible = key_pos[None, :] <= qpos[:, None]
        if window is not None:
            visible &= (qpos[:, None] - key_pos[None, :]) < window
        scores = scores.masked_fill(~visible, -math.inf)
        e = elementary.exp(scores - scores.amax(dim=-1, keepdim=True))
        num = torch.round(e * 2.0**state.prob_bits)  # exact sum below 2**53
        total = num.sum(dim=-1, keepdim=True)
        weights = exact.scale(num, ev.transpose(-1, -2))  # fold each key's value scale in
        acc = _weighted_values(weights, vq, state.value_bits, state.form)
        parts.append((acc / total).view(kvh, groups, len(rows), hd))
    out = torch.cat(parts, dim=2)  # (kvh, groups, m, hd)
    return out.reshape(heads, m, hd).transpose(0, 1)


def _scores_to_values(state, q, kq, ek, vq, ev, qpos, scaling, window):
    """The block above with its elementwise steps in one native pass (kernels.softmax_weights):
    the same two exact products, the same bits; returns (weights @ V, numerator totals)."""
    form, kbits, vbits = state.form, state.key_bits, state.value_bits
    if form != exact.PEAK2:
        xq, ex = exact.quantize_left(q, kbits, form)
    else:
        xq, ex = kernels.split_stacked(exact.f64(q), kbits)
    w, ew, total = kernels.softmax_weights(
        torch.matmul(xq, kq.transpose(-1, -2)),
        ex,
        ek,
        ev,
        qpos,
        state.bits,
        window,
        form,
        scaling,
        elementary.EXP_KERNEL,
    )
    sv = torch.matmul(w, vq)
    if form != exact.PEAK2:
        return exact.scale(sv, ew), total
    # No column scale: each key's value scale is folded into its weight already.
    return kernels.combine(sv, ew, _zeros(sv.shape[-1]), vbits), total


@functools.cache
def _zeros(n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.int64)


def _weighted_values(weights, vq, bits: int, form: int) -> torch.Tensor:
    """Exact ``weights @ V``: weights (.., rows, keys) with each key's scale folded in, quantized
    per row in `form` (one integer per element, or two: see `exact.split_rows`); vq (.., keys,
    hd) of ``bits``."""
    if form != exact.PEAK2:
        wq, ew = exact.quantize_left(weights, bits, form)
        return exact.scale(torch.matmul(wq, vq), ew)
    w1, w2, ew = exact.split_rows(weights, bits)
    rows = w1.shape[-2]
    s = torch.matmul(torch.cat([w1, w2], dim=-2), vq)
    return exact.scale(s[..., :rows, :], ew) + exact.scale(s[..., rows:, :], ew - bits)
