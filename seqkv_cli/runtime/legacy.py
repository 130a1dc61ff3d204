"""The legacy canonical forward (`CanonicalLM`): logits and K/V bit-identical however a
sequence is cut into chunks, on one machine class (the `CanonicalForward` of runtime/forward.py).

An arithmetic decoder can only step token by token, while an encoder and `capture` want to
prefill; ordinary fp32 paths disagree in the last bits (docs/NUMERICS.md). This forward removes
every source of shape-dependent rounding instead of hoping rounding hides it:

* **Row blocks.** Every matrix product runs with a row count padded to a multiple of
  ``ROW_BLOCK`` (8). On the BLAS behind torch's CPU build a row of ``X @ W.T`` is then the same
  bits whatever the other rows are (M = 1, 3, 9 take a GEMV/edge path that is not); the
  ``check_row_invariance`` canary re-checks that on the machine in use.
* **Key blocks.** Attention runs over key blocks of ``KEY_BLOCK`` positions aligned to absolute
  positions. Scores, the row max (exact) and ``exp`` are elementwise or per-row; each block is
  one fixed-shape product ``P_b @ [V_b | 1]`` (numerator and softmax denominator together), and
  blocks are added in block order. Masked keys contribute exact zeros, so a query sees the same
  sums whether later keys exist (prefill) or not (stepping).
* Everything else (RMSNorm, RoPE from a fixed table, SiLU, residual adds) is per row.

The compute dtype stays fp32, so the canonical path is as fast as an ordinary one and within
float rounding of it. Supported: Llama-family decoders (llama, mistral without sliding window,
qwen2).

This is the **legacy** path (``canonical-fp32-rb8-kb256-v1``): its bits depend on the BLAS
kernels, ISA level and thread split of the machine (its SiLU's vector body and scalar tail
round differently, so 3, 5 and 7 threads break it at real widths). New files use the portable
path (runtime/portable); this one stays so that files written with it still decode on their
machine class.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from seqkv_cli.errors import SeqkvError
from seqkv_cli.runtime.forward import check_batch
from seqkv_cli.runtime.model_config import ModelShape, ShapeAttributes
from seqkv_cli.runtime.surprisal import surprisal_bits

ROW_BLOCK = 8
KEY_BLOCK = 256
NUMERIC_PATH = f"canonical-fp32-rb{ROW_BLOCK}-kb{KEY_BLOCK}-v1"
SUPPORTED_TYPES = ("llama", "mistral", "qwen2")


def _round_up(n: int, block: int) -> int:
    return max(block, -(-n // block) * block)


@dataclass
class _Layer:
    ln1: torch.Tensor
    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    bq: torch.Tensor | None
    bk: torch.Tensor | None
    bv: torch.Tensor | None
    wo: torch.Tensor
    ln2: torch.Tensor
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor


class KVState:
    """Static K/V buffers of one sequence: keys (L, kv_heads, cap, hd), values with a ones column.

    The extra ones column of the values turns the softmax denominator into part of the same
    fixed-shape product as the numerator.
    """

    def __init__(self, lm: CanonicalLM, capacity: int) -> None:
        cap = _round_up(capacity, KEY_BLOCK)
        shape = (lm.num_layers, lm.num_kv_heads, cap, lm.head_dim)
        self.keys = torch.zeros(shape, dtype=torch.float32)
        self.values = torch.zeros((*shape[:-1], lm.head_dim + 1), dtype=torch.float32)
        self.values[..., -1] = 1.0
        self.capacity = capacity
        self.length = 0
        self.new_state = lm.new_state  # a fork's buffers come from the same model

    def layer_kv(self, layer: int, n: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer's first ``n`` positions (default: all), (kv_heads, n, head_dim)."""
        n = self.length if n is None else n
        return self.keys[layer, :, :n], self.values[layer, :, :n, :-1]

    def fork(self, length: int, capacity: int) -> KVState:
        """A new state holding this one's first ``length`` positions (a trie branch point)."""
        out = self.new_state(capacity)
        out.keys[:, :, :length] = self.keys[:, :, :length]
        out.values[:, :, :length, :-1] = self.values[:, :, :length, :-1]
        out.length = length
        return out

    def crop(self, tokens: int) -> None:
        """Forget the last ``-tokens`` positions, as `PortableState.crop` (transformers'
        `Cache.crop` convention); their K/V rows are overwritten by the next call."""
        if tokens > 0 or -tokens > self.length:
            raise ValueError(f"cannot crop {tokens} positions from a state of {self.length}")
        self.length += tokens


class CanonicalLM(ShapeAttributes):
    """A lean Llama-family forward with the legacy canonical numerics described above: a
    `CanonicalForward` whose states are `KVState`."""

    numeric_path = NUMERIC_PATH
    surprisal = staticmethod(surprisal_bits)

    def __init__(self, hf_model) -> None:
        cfg = hf_model.config
        model_type = getattr(cfg, "model_type", "?")
        if model_type not in SUPPORTED_TYPES or getattr(cfg, "hidden_act", "silu") != "silu":
            raise SeqkvError(
                f"canonical numerics support {', '.join(SUPPORTED_TYPES)} models, not "
                f"'{model_type}'; use --no-canonical for an ordinary (non-reproducible) run"
            )
        if model_type == "mistral" and getattr(cfg, "sliding_window", None):
            raise SeqkvError("canonical numerics do not support sliding-window attention")
        base = hf_model.model
        # A multimodal wrapper is refused above by its own model_type: the decoders this path
        # runs keep their numbers in the top config, which `ModelShape` then reads.
        self.shape = ModelShape.of(cfg)
        self.eps = cfg.rms_norm_eps
        self.scaling = self.head_dim**-0.5
        p = {k: v.detach().float() for k, v in hf_model.state_dict().items()}
        self.embed = p["model.embed_tokens.weight"]
        self.lm_head = p.get("lm_head.weight", self.embed)
        self.norm = p["model.norm.weight"]
        self.layers = [self._layer(p, i) for i in range(self.num_layers)]
        # RoPE table from the model's own inverse frequencies, computed once for all positions.
        inv_freq = base.rotary_emb.inv_freq.detach().double()
        scale = float(getattr(base.rotary_emb, "attention_scaling", 1.0))
        angles = torch.arange(self.max_context, dtype=torch.float64)[:, None] * inv_freq[None, :]
        angles = torch.cat([angles, angles], dim=-1)
        self.cos = (angles.cos() * scale).float()
        self.sin = (angles.sin() * scale).float()

    @staticmethod
    def _layer(p: dict, i: int) -> _Layer:
        pre = f"model.layers.{i}."
        return _Layer(
            ln1=p[pre + "input_layernorm.weight"],
            wq=p[pre + "self_attn.q_proj.weight"],
            wk=p[pre + "self_attn.k_proj.weight"],
            wv=p[pre + "self_attn.v_proj.weight"],
            bq=p.get(pre + "self_attn.q_proj.bias"),
            bk=p.get(pre + "self_attn.k_proj.bias"),
            bv=p.get(pre + "self_attn.v_proj.bias"),
            wo=p[pre + "self_attn.o_proj.weight"],
            ln2=p[pre + "post_attention_layernorm.weight"],
            w_gate=p[pre + "mlp.gate_proj.weight"],
            w_up=p[pre + "mlp.up_proj.weight"],
            w_down=p[pre + "mlp.down_proj.weight"],
        )

    def new_state(self, capacity: int) -> KVState:
        if capacity > self.max_context:
            raise SeqkvError(f"{capacity} positions exceed the model context ({self.max_context})")
        return KVState(self, capacity)

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """RMSNorm of each row of `x` with weight `w` and the model's epsilon, in fp32."""
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Apply rotary embeddings (rows of the `cos`/`sin` tables) to the last dim of `x`."""
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    @torch.inference_mode()
    def forward(self, state: KVState, token_ids: torch.Tensor) -> torch.Tensor:
        """Append `token_ids` (M,) to `state`; return their next-token logits (M, vocab), fp32."""
        if int(token_ids.shape[0]) == 0:
            return torch.empty((0, self.vocab_size))
        return self._run([(state, token_ids.long())])

    @torch.inference_mode()
    def forward_rows(self, states: list[KVState], token_ids: list[int]) -> torch.Tensor:
        """Append one token to each of several sequences in one pass; logits (B, vocab).

        The sequences share the weight products (rows of one product) and keep their own
        attention, so each gets the same bits as if it were stepped alone.
        """
        check_batch(states, call="forward_rows")
        return self._run([(s, torch.tensor([t])) for s, t in zip(states, token_ids, strict=True)])

    @torch.inference_mode()
    def forward_many(self, states: list[KVState], token_ids: list) -> list[torch.Tensor]:
        """Append token_ids[i] (one or more) to states[i] in one pass; logits of each, (m_i, V)."""
        check_batch(states, token_ids, "forward_many")
        segments = [
            (s, torch.tensor([int(t) for t in ids], dtype=torch.long))
            for s, ids in zip(states, token_ids, strict=True)
        ]
        logits = self._run(segments)
        out, start = [], 0
        for _, ids in segments:
            out.append(logits[start : start + len(ids)])
            start += len(ids)
        return out

    def _run(self, segments: list[tuple[KVState, torch.Tensor]]) -> torch.Tensor:
        for state, ids in segments:
            if state.length + len(ids) > state.capacity:
                raise SeqkvError(f"sequence longer than the state's capacity ({state.capacity})")
        total = sum(len(ids) for _, ids in segments)
        t_pad = _round_up(total, ROW_BLOCK)
        # Padding rows repeat the last row; they are computed and dropped.
        rows = torch.arange(t_pad).clamp_(max=total - 1)
        ids = torch.cat([ids for _, ids in segments])[rows]
        pos = torch.cat([s.length + torch.arange(len(i)) for s, i in segments])[rows]
        cos, sin = self.cos[pos][:, None, :], self.sin[pos][:, None, :]
        plans, start = [], 0
        for state, seg in segments:
            plans.append(self._plan(state, start, len(seg)))
            start += len(seg)
        h = self.embed[ids]
        for li, layer in enumerate(self.layers):
            x = self.rms_norm(h, layer.ln1)
            q = F.linear(x, layer.wq, layer.bq).view(t_pad, self.num_heads, self.head_dim)
            k = F.linear(x, layer.wk, layer.bk).view(t_pad, self.num_kv_heads, self.head_dim)
            v = F.linear(x, layer.wv, layer.bv).view(t_pad, self.num_kv_heads, self.head_dim)
            q, k = self.rotate(q, cos, sin), self.rotate(k, cos, sin)
            attn = torch.empty((t_pad, self.num_heads * self.head_dim))
            for state, first, m, local, masked, n_blocks in plans:
                p0 = state.length
                state.keys[li, :, p0 : p0 + m] = k[first : first + m].transpose(0, 1)
                state.values[li, :, p0 : p0 + m, :-1] = v[first : first + m].transpose(0, 1)
                attn[first : first + m] = self._attention(state, li, q[local], masked, n_blocks)[:m]
            attn[total:] = attn[total - 1]
            h = h + F.linear(attn, layer.wo)
            x = self.rms_norm(h, layer.ln2)
            h = h + F.linear(
                F.silu(F.linear(x, layer.w_gate)) * F.linear(x, layer.w_up), layer.w_down
            )
        for state, ids_ in segments:
            state.length += len(ids_)
        return F.linear(self.rms_norm(h, self.norm), self.lm_head)[:total]

    def _plan(self, state: KVState, first: int, m: int):
        """A segment's attention rows: its own rows padded to a row block, and its key mask."""
        m_pad = _round_up(m, ROW_BLOCK)
        offsets = torch.arange(m_pad).clamp_(max=m - 1)
        n_blocks = -(-(state.length + m) // KEY_BLOCK)
        groups = self.num_heads // self.num_kv_heads
        row_pos = (state.length + offsets).repeat(groups)  # rows of the grouped query matrix
        masked = torch.arange(n_blocks * KEY_BLOCK)[None, :] > row_pos[:, None]
        return state, first, m, first + offsets, masked, n_blocks

    def _attention(self, state, li, q, masked, n_blocks) -> torch.Tensor:
        m_pad, hd, kvh = q.shape[0], self.head_dim, self.num_kv_heads
        groups = self.num_heads // kvh
        # (kv_heads, groups * rows, hd): query head h uses kv head h // groups, as in HF repeat_kv.
        qg = q.view(m_pad, kvh, groups, hd).permute(1, 2, 0, 3).reshape(kvh, groups * m_pad, hd)
        n_keys = n_blocks * KEY_BLOCK
        scores = torch.matmul(qg, state.keys[li, :, :n_keys].transpose(1, 2)).mul_(self.scaling)
        scores.masked_fill_(masked, -math.inf)
        # In place: the same elementwise kernels as out-of-place ops, without the copies.
        probs = scores.sub_(scores.amax(dim=-1, keepdim=True)).exp_()
        probs = probs.view(kvh, groups * m_pad, n_blocks, KEY_BLOCK).transpose(1, 2).contiguous()
        vals = state.values[li, :, :n_keys].reshape(kvh, n_blocks, KEY_BLOCK, hd + 1)
        parts = torch.matmul(probs, vals)  # (kv_heads, blocks, rows, hd + 1)
        acc = parts[:, 0]
        for b in range(1, n_blocks):  # fixed block order; masked blocks add exact zeros
            acc = acc + parts[:, b]
        out = acc[..., :hd] / acc[..., hd:]
        out = out.view(kvh, groups, m_pad, hd).permute(2, 0, 1, 3)
        return out.reshape(m_pad, kvh * groups * hd)


def check_row_invariance(dim: int = 576, seed: int = 0) -> bool:
    """Canary: is a row of a row-block-padded product independent of the other rows here?"""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(3 * dim, dim, generator=gen)
    x = torch.randn(64, dim, generator=gen)
    full = F.linear(x, w)
    return all(
        torch.equal(F.linear(x[s : s + n], w), full[s : s + n])
        for s, n in ((0, 8), (8, 16), (24, 8), (40, 24))
    )
