"""What-if forward: the K/V a position *would* have if another token (or embedding) sat there.

Predictive delta coding (arXiv 2604.15356, Layer 2) needs F(t_<p, x): the per-layer K/V of
position p for a candidate input x, given the true prefix. A candidate row attends to the
cached K/V of positions < p (the exact ones, from a canonical prefill) plus its own key and
value — not to other candidate rows and not to the cached entry at p.

The computation mirrors `CanonicalLM.forward` operation by operation, so that a row holding
the true token reproduces the cached K/V bit for bit: every product keeps the row-block
padding, the candidate's own score replaces column p of the shared score matrix, and the
key block that holds p is multiplied once per row with the candidate's value written into
it. Blocks are summed in block order, as in the canonical attention. On a row-invariant BLAS
(the property `check_row_invariance` guards) rows never influence each other's bits, so the
result does not depend on how rows are batched; callers still use one fixed schedule.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from seqkv_cli.errors import SeqkvError
from seqkv_cli.runtime.legacy import KEY_BLOCK, ROW_BLOCK, CanonicalLM, KVState

MAX_ROWS = 256  # rows per internal pass: bounds the (rows x rows) own-score product


def _round_up(n: int, block: int) -> int:
    return max(block, -(-n // block) * block)


def branch_kv(
    canon: CanonicalLM, state: KVState, positions: torch.Tensor, embeds: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V, each (num_layers, R, kv_heads, head_dim) fp32, of R candidate rows.

    ``positions`` (R,) int: where each row sits; every position must be <= ``state.length``
    (its whole prefix cached). ``embeds`` (R, hidden) fp32: each row's input embedding —
    ``canon.embed[token]`` for a token, any vector for a "soft" token.
    """
    r = int(positions.shape[0])
    if positions.dim() != 1 or embeds.shape != (r, canon.embed.shape[1]):
        raise SeqkvError(f"branch rows: {r} positions but embeddings of shape {embeds.shape}")
    if r == 0:
        empty = torch.empty((canon.num_layers, 0, canon.num_kv_heads, canon.head_dim))
        return empty, empty.clone()
    if int(positions.min()) < 0 or int(positions.max()) > state.length:
        raise SeqkvError(f"branch rows must sit at positions 0..{state.length} (the cached prefix)")
    if -(-(int(positions.max()) + 1) // KEY_BLOCK) * KEY_BLOCK > state.keys.shape[2]:
        raise SeqkvError("branch rows lie beyond the state's key buffer")
    parts = [
        _branch(canon, state, positions[s : s + MAX_ROWS], embeds[s : s + MAX_ROWS])
        for s in range(0, r, MAX_ROWS)
    ]
    return torch.cat([k for k, _ in parts], 1), torch.cat([v for _, v in parts], 1)


@torch.inference_mode()
def _branch(canon: CanonicalLM, state, positions, embeds) -> tuple[torch.Tensor, torch.Tensor]:
    r = int(positions.shape[0])
    r_pad = _round_up(r, ROW_BLOCK)
    rows = torch.arange(r_pad).clamp_(max=r - 1)  # padding repeats the last row, then is dropped
    pos = positions.long()[rows]
    n_blocks = -(-(int(pos.max()) + 1) // KEY_BLOCK)
    cos, sin = canon.cos[pos][:, None, :], canon.sin[pos][:, None, :]
    h = embeds.float()[rows]
    keys, values = [], []
    for li, layer in enumerate(canon.layers):
        x = canon.rms_norm(h, layer.ln1)
        k = F.linear(x, layer.wk, layer.bk).view(r_pad, canon.num_kv_heads, canon.head_dim)
        v = F.linear(x, layer.wv, layer.bv).view(r_pad, canon.num_kv_heads, canon.head_dim)
        k = canon.rotate(k, cos, sin)
        keys.append(k[:r])
        values.append(v[:r])
        if li == canon.num_layers - 1:
            break  # the last layer's output feeds only the logits, which are not needed
        q = F.linear(x, layer.wq, layer.bq).view(r_pad, canon.num_heads, canon.head_dim)
        q = canon.rotate(q, cos, sin)
        attn = _attention(canon, state, li, q, k, v, pos, n_blocks)
        h = h + F.linear(attn, layer.wo)
        x = canon.rms_norm(h, layer.ln2)
        h = h + F.linear(F.silu(F.linear(x, layer.w_gate)) * F.linear(x, layer.w_up), layer.w_down)
    return torch.stack(keys), torch.stack(values)


def _attention(canon: CanonicalLM, state, li, q, k, v, pos, n_blocks) -> torch.Tensor:
    """`CanonicalLM._attention` with each row's own key/value standing in at its position."""
    r_pad, hd, kvh = q.shape[0], canon.head_dim, canon.num_kv_heads
    groups = canon.num_heads // kvh
    n_keys = n_blocks * KEY_BLOCK
    qg = q.view(r_pad, kvh, groups, hd).permute(1, 2, 0, 3).reshape(kvh, groups * r_pad, hd)
    scores = torch.matmul(qg, state.keys[li, :, :n_keys].transpose(1, 2)) * canon.scaling
    # Own scores: row g * r_pad + j against key j; the diagonal of a same-kernel product.
    own = torch.matmul(qg, _pad_columns(k.transpose(0, 1)).transpose(1, 2)) * canon.scaling
    row_idx = torch.arange(groups * r_pad)
    mine = row_idx % r_pad
    row_pos = pos[mine]
    scores[:, row_idx, row_pos] = own[:, row_idx, mine]
    scores.masked_fill_(torch.arange(n_keys)[None, :] > row_pos[:, None], -math.inf)
    probs = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
    probs = probs.view(kvh, groups * r_pad, n_blocks, KEY_BLOCK).transpose(1, 2).contiguous()
    vals = state.values[li, :, :n_keys].reshape(kvh, n_blocks, KEY_BLOCK, hd + 1)
    parts = torch.matmul(probs, vals)  # (kv_heads, blocks, rows, hd + 1)
    # The block holding each row's position, with the row's own value written into it.
    blk, off = pos // KEY_BLOCK, pos % KEY_BLOCK
    own_vals = vals[:, blk]  # a gathered copy: (kv_heads, r_pad, KEY_BLOCK, hd + 1)
    own_vals[:, torch.arange(r_pad), off, :hd] = v.transpose(0, 1)
    own_probs = probs[:, blk[mine], row_idx].view(kvh, groups, r_pad, KEY_BLOCK).transpose(1, 2)
    g_pad = _round_up(groups, ROW_BLOCK)
    own_probs = F.pad(own_probs, (0, 0, 0, g_pad - groups))  # zero rows up to a row block
    own_parts = torch.matmul(own_probs, own_vals)[:, :, :groups]  # (kv_heads, r_pad, groups, .)
    parts[:, blk[mine], row_idx] = own_parts.transpose(1, 2).reshape(kvh, groups * r_pad, hd + 1)
    acc = parts[:, 0]
    for b in range(1, n_blocks):  # fixed block order, as in the canonical attention
        acc = acc + parts[:, b]
    out = acc[..., :hd] / acc[..., hd:]
    out = out.view(kvh, groups, r_pad, hd).permute(2, 0, 1, 3)
    return out.reshape(r_pad, kvh * groups * hd)


def _pad_columns(k: torch.Tensor) -> torch.Tensor:
    """(kv_heads, r_pad, hd) keys padded with zero rows to whole key blocks (product width)."""
    n = k.shape[1]
    return F.pad(k, (0, 0, 0, _round_up(n, KEY_BLOCK) - n))
