"""`delta-topk`: the paper's Layer 2 — predictive delta coding of K/V (arXiv 2604.15356).

Token ids are stored exactly as `seq` stores them. K/V of position i is predicted from the
model's next-token distribution given the true prefix and only the residual is stored:

* ``variant="topk"``: KV̂_i = Σ_k p_k · F(t_<i, k) over the K most likely next tokens
  (probabilities renormalised over those K; ties broken by lower token id), where F is the
  K/V position i would have with token k there (`branch.branch_kv`).
* ``variant="linear"``: one "soft token" row whose input embedding is Σ_t P(t) · E(t) over the
  whole vocabulary: KV̂_i = F(t_<i, E[P]).

Position 0 has no distribution and is predicted as zero. The residual R = KV - KV̂ is
quantized with b_i = clamp(round(base + slope · s_i), 0, max_bits) bits per component, s_i the
surprisal of token i (s_0 = log2 V, the uniform first-token cost), by
`seqkv_codecs.adaptive_quant`. The decoder decodes the tokens, recomputes KV̂ with the same
fixed schedule (bit-identical) and adds R̂. Since the tokens alone already restore K/V exactly
(`seq`), this costs `seq`'s bits plus the residual: it is measured, not expected, to win.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from seqkv_cli.errors import SeqkvError
from seqkv_cli.kvcapture.capture_file import DTYPES, Capture
from seqkv_cli.runtime.numerics import LEGACY
from seqkv_cli.sequential.session_codec import EncodedSession, SessionCodec
from seqkv_cli.sequential.surprisal_part import (
    decode_surprisal_part,
    encode_surprisal_part,
    plausible_surprisal_part,
)

if TYPE_CHECKING:
    from seqkv_cli.runtime.forward import CanonicalForward

VARIANTS = ("topk", "linear")
PREFILL_CHUNK = 256  # as `capture`: the same logits, so the same surprisal bits
ROWS_PER_PASS = 256  # candidate rows per branch pass (rows are independent; this bounds memory)


@dataclass
class Prediction:
    """KV̂ per layer (kv_heads, n, head_dim) fp32, and surprisal (n - 1,) of tokens 1..n-1."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    surprisal: torch.Tensor


@torch.inference_mode()
def predict_kv(canon: CanonicalForward, tokens: np.ndarray, *, k: int, variant: str) -> Prediction:
    """KV̂ of every position of ``tokens`` from a canonical prefill plus what-if rows."""
    from seqkv_cli.kvcapture.engine import surprisal_bits
    from seqkv_cli.sequential.branch import branch_kv

    ids = torch.from_numpy(np.asarray(tokens, dtype=np.int64))
    n, k = len(ids), min(k, canon.vocab_size)
    state = canon.new_state(n)
    per_row = 1 if variant == "linear" else k
    inputs, weights, surprisal = [], [], []
    for s in range(0, n, PREFILL_CHUNK):
        logits = canon.forward(state, ids[s : s + PREFILL_CHUNK])
        nxt = ids[s + 1 : s + 1 + PREFILL_CHUNK]
        logits = logits[: len(nxt)]  # row j predicts position s + 1 + j
        surprisal.append(surprisal_bits(logits, nxt))
        if variant == "linear":
            inputs.append(torch.softmax(logits, dim=-1) @ canon.embed)
            weights.append(torch.ones((len(nxt), 1)))
        else:
            top, order = top_k(logits, k)
            inputs.append(order.reshape(-1))  # token ids; embedded per pass
            weights.append(torch.softmax(top.double(), dim=-1).float())
    shape = (canon.num_layers, canon.num_kv_heads, n, canon.head_dim)
    keys, values = torch.zeros(shape), torch.zeros(shape)
    inputs, probs = torch.cat(inputs), torch.cat(weights)
    step = max(1, ROWS_PER_PASS // per_row)
    for a in range(1, n, step):
        b = min(a + step, n)
        span = slice((a - 1) * per_row, (b - 1) * per_row)
        x = inputs[span] if variant == "linear" else canon.embed[inputs[span]]
        fk, fv = branch_kv(canon, state, torch.arange(a, b).repeat_interleave(per_row), x)
        for out, f in ((keys, fk), (values, fv)):
            f = f.view(canon.num_layers, b - a, per_row, canon.num_kv_heads, canon.head_dim)
            p = probs[a - 1 : b - 1]
            acc = p[None, :, 0, None, None] * f[:, :, 0]
            for j in range(1, per_row):  # fixed order: the same bits on both sides
                acc = acc + p[None, :, j, None, None] * f[:, :, j]
            out[:, :, a:b] = acc.transpose(1, 2)
    surp = torch.cat(surprisal) if surprisal else torch.zeros(0, dtype=torch.float64)
    return Prediction(list(keys), list(values), surp)


def top_k(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, ids) (rows, k) of each row's k largest logits, larger first, ties to the lower
    id: the first k of a stable descending sort, without sorting the vocabulary.

    torch.topk finds the k-th largest value but orders ties as it likes; every symbol at or
    above that value is a candidate (k, plus any ties at it), and only the candidates are
    sorted. A full sort of a 256,000-token row per position cost ~10x this (issue 36)."""
    kth = torch.topk(logits, k, dim=-1).values[:, -1:]
    rows, ids = torch.nonzero(logits >= kth, as_tuple=True)  # row-major: ids rise in a row
    values = logits[rows, ids]
    # stable sorts, least significant key first: value descending, then row (ids kept rising)
    order = torch.sort(values, descending=True, stable=True).indices
    order = order[torch.sort(rows[order], stable=True).indices]
    counts = torch.bincount(rows, minlength=len(logits))
    starts = torch.cumsum(counts, 0) - counts
    pick = order[(starts[:, None] + torch.arange(k)).reshape(-1)]
    return values[pick].view(-1, k), ids[pick].view(-1, k)


def _residual_p95(delta: np.ndarray, n: int, canon: CanonicalForward) -> dict:
    """Per layer, K and V: the 95th percentile of the dequantized residual's magnitude."""
    mag = np.abs(delta.reshape(n, canon.num_layers, 2, -1))
    return {
        kind: [
            float(np.percentile(mag[:, layer, j], 95)) if n else 0.0
            for layer in range(canon.num_layers)
        ]
        for j, kind in enumerate(("key", "value"))
    }


def flatten_kv(keys, values) -> torch.Tensor:
    """Per-layer (kv_heads, n, hd) K and V -> (n, layers * 2 * kv_heads * hd) fp32."""
    kv = torch.stack([torch.stack(list(keys)), torch.stack(list(values))], 1).float()
    return kv.permute(3, 0, 1, 2, 4).reshape(kv.shape[3], -1)


class DeltaTopKCodec(SessionCodec):
    codec_id = "delta-topk"
    description = (
        "token ids as in seq + K/V predicted from the model's top-K next tokens (or one "
        "expected-embedding row) + surprisal-adaptive quantized residual (lossy)"
    )
    lossless = False
    typical_bits_per_component = None
    steps_model = True  # its token ids are coded as seq's are
    trie_capable = False  # its residual is predicted per session: flat layout only
    takes_residual = False

    def __init__(
        self,
        k: int = 20,
        variant: str = "topk",
        max_bits: int = 4,
        base: float = 2.0,
        slope: float = 1.0,
        precision_bits: int = 24,
        chunk_size: int = 1024,
        numerics: str = LEGACY,
    ) -> None:
        from seqkv_codecs.adaptive_quant import MAX_BITS

        if numerics != LEGACY:
            # Its what-if forward (sequential/branch.py) mirrors the lean legacy forward only.
            raise SeqkvError(f"delta-topk runs on the {LEGACY} numeric path only, not {numerics}")
        self.numerics = numerics

        if variant not in VARIANTS:
            raise SeqkvError(f"unknown delta-topk variant '{variant}'; use one of {VARIANTS}")
        if not isinstance(k, int) or k < 1 or not isinstance(max_bits, int):
            raise SeqkvError(f"delta-topk needs integers k >= 1 and max_bits, got {k}, {max_bits}")
        if not 0 <= max_bits <= MAX_BITS or not math.isfinite(base + slope):
            raise SeqkvError(f"delta-topk: max_bits must be in 0..{MAX_BITS}, base/slope finite")
        self.k, self.variant, self.max_bits = k, variant, max_bits
        self.base, self.slope = float(base), float(slope)
        self.precision_bits, self.chunk_size = precision_bits, chunk_size

    def get_config(self) -> dict:
        keys = ("k", "variant", "max_bits", "base", "slope", "precision_bits", "chunk_size")
        return {"id": self.codec_id, **{key: getattr(self, key) for key in keys}}

    def encode_tokens(self, tokens, adapter):
        """Token ids coded as seq's are: one stream under the model."""
        from seqkv_codecs.sequential import encode_tokens_with_stats

        data, stats = encode_tokens_with_stats(
            tokens, adapter, precision_bits=self.precision_bits, chunk_size=self.chunk_size
        )
        return data, stats.ideal_bits

    def decode_tokens_many(self, datas, adapter):
        """Each stream on its own (the K/V come from the predictor, not from a track)."""
        from seqkv_codecs.errors import CodecError
        from seqkv_codecs.sequential import decode_tokens

        out = []
        for data in datas:
            try:
                out.append((decode_tokens(data, adapter), None))
            except CodecError as exc:
                out.append((exc, None))
        return out

    def _bits(self, surprisal: torch.Tensor, vocab: int) -> np.ndarray:
        from seqkv_codecs.adaptive_quant import bits_from_surprisal

        s = np.concatenate([[math.log2(vocab)], surprisal.numpy()])
        return bits_from_surprisal(s, base=self.base, slope=self.slope, max_bits=self.max_bits)

    def encode(self, cap: Capture, canon: CanonicalForward) -> EncodedSession:
        from seqkv_cli.sequential.adapter import CanonicalLogits
        from seqkv_codecs.adaptive_quant import quantize

        shape = (canon.num_kv_heads, cap.positions, canon.head_dim)
        if len(cap.keys) != canon.num_layers or any(t.shape != shape for t in cap.keys):
            raise SeqkvError(f"capture {cap.session_id} does not match the model's K/V shapes")
        tokens = cap.tokens.numpy().astype(np.int64)
        data, ideal_bits = self.encode_tokens(tokens, CanonicalLogits(canon))
        pred = predict_kv(canon, tokens, k=self.k, variant=self.variant)
        actual = flatten_kv(cap.keys, cap.values)
        residual = actual - flatten_kv(pred.keys, pred.values)
        bits = self._bits(pred.surprisal, canon.vocab_size)
        delta = quantize(residual.numpy(), bits, canon.head_dim, self.max_bits)
        rel = float(residual.norm() / actual.norm().clamp_min(1e-30))
        out = EncodedSession({"tokens.seq": data, "delta": delta}, ideal_bits, len(delta))
        what = f"top-{self.k}" if self.variant == "topk" else "linear (expected embedding)"
        out.notes.append(
            f"{what} predictor: relative L2 error {rel:.4f} before the "
            f"residual; mean {bits.mean():.2f} bits/component, {int((bits == 0).sum())} of "
            f"{len(bits)} positions with none"
        )
        if not torch.equal(pred.surprisal, cap.surprisal.double()):
            out.parts["surprisal"] = encode_surprisal_part(cap.surprisal, pred.surprisal)
            out.notes.append("surprisal differs from recomputation; stored against it")
        return out

    def decode(
        self, entry: dict, read: Callable[[str], bytes | None], canon: CanonicalForward
    ) -> Capture:
        from seqkv_cli.sequential.adapter import CanonicalLogits
        from seqkv_codecs.adaptive_quant import dequantize
        from seqkv_codecs.errors import CorruptStreamError

        token_data, delta, n = read("tokens.seq"), read("delta"), entry["positions"]
        if token_data is None or delta is None:
            raise SeqkvError(f"session {entry['id']}: the token or delta stream is missing")
        deq = dequantize(delta, max_positions=n)  # before any model work: fail fast
        [(tokens, _)] = self.decode_tokens_many([token_data], CanonicalLogits(canon))
        if isinstance(tokens, Exception):
            raise tokens
        if len(tokens) != n:
            raise SeqkvError(f"session {entry['id']}: {len(tokens)} tokens, header says {n}")
        pred = predict_kv(canon, tokens, k=self.k, variant=self.variant)
        flat = flatten_kv(pred.keys, pred.values)
        if deq.values.shape != tuple(flat.shape):
            raise CorruptStreamError(f"delta stream holds {deq.values.shape}, not {flat.shape}")
        kv = (flat + torch.from_numpy(deq.values)).to(DTYPES[entry["dtype"]])
        kv = kv.view(n, canon.num_layers, 2, canon.num_kv_heads, canon.head_dim)
        kv = kv.permute(1, 2, 3, 0, 4)  # (layers, 2, kv_heads, n, head_dim)
        stored = read("surprisal")
        surprisal = pred.surprisal
        if stored is not None:
            if not plausible_surprisal_part(stored, max(n - 1, 0)):
                raise CorruptStreamError("stored surprisal has the wrong length")
            surprisal = decode_surprisal_part(stored, pred.surprisal)
        meta = {"session_id": entry["id"], "dtype": entry["dtype"]}  # Archive completes it
        keys, values = [t.contiguous() for t in kv[:, 0]], [t.contiguous() for t in kv[:, 1]]
        cap = Capture(torch.from_numpy(tokens), keys, values, surprisal, meta)
        cap.residual_p95 = _residual_p95(deq.values, n, canon)
        return cap

    def decode_many(self, entries: list[dict], reads: list, canon: CanonicalForward) -> list:
        """Captures, or the error of each session that failed; one session at a time."""
        from seqkv_codecs.errors import CodecError

        out: list = []
        for entry, read in zip(entries, reads, strict=True):
            try:
                out.append(self.decode(entry, read, canon))
            except (SeqkvError, CodecError) as exc:
                out.append(exc)
        return out
