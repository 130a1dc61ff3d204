"""A fused forward for Llama-like decoders: the reference's bits, without per-op dispatch.

`PortableMode` runs a model's own transformers code and intercepts every aten op in Python
(about 1,500 a step for the embedded model, ~60% of a step's time once the products are
native). For the families that matter most here — llama, mistral, qwen2, qwen3, whose decoder
layers are the same RMSNorm → attention → RMSNorm → gated MLP — this module issues, in the
same order and the same dtypes, exactly the operations the reference issues under the mode:
products and transcendentals through `exact` (and so its native kernels), everything else the
very torch op the mode would have let through. It is an optimisation, never a definition:

* `PortableLM` probes it against the reference on every load (a prefill, a chunk and a step,
  logits and K/V compared bit for bit) and keeps the reference where they differ — a
  transformers release that reorders a residual add changes the reference, and the probe sees
  it before a single token is coded;
* `tests/runtime/test_fused_forward.py` proves it bit-identical on tiny models of each family
  (prefill, chunks, steps, rows) and on the embedded model.
"""

from __future__ import annotations

import torch

from seqkv_cli.runtime.portable import elementary, exact
from seqkv_cli.runtime.portable.attention import attend

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def fusable(hf_model, model_type: str) -> bool:
    """Whether `FusedDecoder` mirrors this model's code (family, rope type, activation)."""
    if model_type not in FAMILIES:
        return False
    cfg = hf_model.config
    base = getattr(hf_model, "model", None)
    rotary = getattr(base, "rotary_emb", None)
    rope_type = getattr(rotary, "rope_type", None)
    if not isinstance(rope_type, str) or "dynamic" in rope_type or rope_type == "longrope":
        return False  # those rescale inv_freq per call (dynamic_rope_update)
    if getattr(cfg, "hidden_act", None) != "silu" or getattr(cfg, "mlp_bias", False):
        return False
    return hasattr(hf_model, "lm_head") and hasattr(base, "layers")


class FusedDecoder:
    """``run(states, ids, positions)``: the logits `PortableLM._run` would get from the model."""

    def __init__(self, hf_model, weights, form: int, rotary_inv_freq: torch.Tensor) -> None:
        self.model = hf_model
        self.base = hf_model.model
        self.cfg = hf_model.config
        self.weights = weights
        self.form = form
        self.inv_freq = rotary_inv_freq
        self.attention_scaling = self.base.rotary_emb.attention_scaling
        self.model_type = self.cfg.model_type

    # -- the reference's operations, one by one ------------------------------------------

    def _linear(self, x: torch.Tensor, *modules) -> list[torch.Tensor]:
        """op_policy._linear of each module over the same x: exact product, fp64 bias add, back to
        x's dtype; several modules go through one product of their stacked rows."""
        bits = exact.right_bits(x.shape[-1], self.form)
        if len(modules) == 1:
            weight = self.weights.rows(modules[0].weight, bits)
        else:
            weight = self.weights.stacked([m.weight for m in modules], bits)
        both = weight.product(x, bits, self.form)
        sizes = [m.weight.shape[0] for m in modules]
        outs = []
        for module, out in zip(modules, both.split(sizes, dim=-1), strict=True):
            if module.bias is not None:
                out = out + module.bias.to(torch.float64)
            outs.append(out.to(x.dtype))
        return outs

    @staticmethod
    def _rms_norm(x: torch.Tensor, module) -> torch.Tensor:
        """LlamaRMSNorm under the mode: pow(2) and rsqrt via fp64, mean by the fixed tree."""
        a = x.to(torch.float64)
        squared = (a * a).to(torch.float32)  # elementary.power(x, 2)
        variance = (elementary.tree_sum(squared, -1, keepdim=True) / x.shape[-1]).to(torch.float32)
        inv = elementary.rsqrt(variance + module.variance_epsilon)
        return module.weight * (x * inv)

    def _rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq.to(dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = elementary.cos(emb) * self.attention_scaling
        sin = elementary.sin(emb) * self.attention_scaling
        return cos, sin

    @staticmethod
    def _rotate(x, cos, sin):
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return (x * cos) + (rotated * sin)

    def _window(self, attn) -> int | None:
        if hasattr(attn, "sliding_window"):
            return attn.sliding_window  # qwen2/qwen3: per layer type
        if self.model_type == "mistral":
            return getattr(self.cfg, "sliding_window", None)
        return None

    def _attention(self, layer, attn, x, cos, sin, states) -> torch.Tensor:
        batch, seq = x.shape[:2]
        shape = (batch, seq, -1, attn.head_dim)
        q, k, v = (p.view(shape) for p in self._linear(x, attn.q_proj, attn.k_proj, attn.v_proj))
        if hasattr(attn, "q_norm"):  # qwen3: RMSNorm over each head before the rotation
            q, k = self._rms_norm(q, attn.q_norm), self._rms_norm(k, attn.k_norm)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
        for row, state in enumerate(states):  # RowsCache.update
            state.write(layer, k[row].float(), v[row].float())
        window = self._window(attn)
        outs = [
            attend(state, layer, q[row], attn.scaling, window, None)
            for row, state in enumerate(states)
        ]
        out = torch.stack(outs).to(q.dtype).reshape(batch, seq, -1).contiguous()
        return self._linear(out, attn.o_proj)[0]

    def _mlp(self, mlp, x) -> torch.Tensor:
        gate, up = self._linear(x, mlp.gate_proj, mlp.up_proj)
        return self._linear(elementary.silu(gate) * up, mlp.down_proj)[0]

    @torch.inference_mode()
    def run(self, states, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Logits (batch, seq, vocab) for ids (batch, seq) at positions; writes each row's K/V."""
        h = self.weights.embedding(self.base.embed_tokens.weight, ids)
        cos, sin = self._rotary(positions)
        for layer, block in enumerate(self.base.layers[: self.cfg.num_hidden_layers]):
            x = self._rms_norm(h, block.input_layernorm)
            h = h + self._attention(layer, block.self_attn, x, cos, sin, states)
            x = self._rms_norm(h, block.post_attention_layernorm)
            h = h + self._mlp(block.mlp, x)
        h = self._rms_norm(h, self.base.norm)
        return self._linear(h, self.model.lm_head)[0]
