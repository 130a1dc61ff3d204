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

import numpy as np
import torch

from seqkv_cli.runtime.portable import elementary, exact, kernels
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
        # Whether `run` takes `step` for one token a row: None until PortableLM has compared
        # the two on this machine, before the first step (`PortableLM._step_check`).
        self.native_step: bool | None = None
        self._held: dict = {}  # module -> what a step reads of it (`_hold`)

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

    # -- a step: one token a row, the same operations on numpy rows ------------------------
    #
    # A step (every row one token: decoding, trie rows in lockstep) runs the same operations
    # in the same order with no torch op between the products: the products, the norms, SiLU
    # and a layer's attention (its rotary, cache write and attend) are native kernels, the
    # rest single numpy operations on fp32 or fp64 rows (each one correctly rounded, as
    # torch's are). What a step reads of each module is looked up once (`_hold`): a step runs
    # hundreds of them. `run` takes it once `PortableLM._step_check` has compared it with the
    # torch path on this machine.

    def _native_linear(self, x: np.ndarray, *modules) -> list[np.ndarray]:
        """`_linear` of fp32 rows x (M, K): each module's fp32 output (M, N)."""
        bits = exact.right_bits(x.shape[-1], self.form)
        l1 = self.form == exact.L1
        outs = []
        for module in modules:
            part, peaks, runs, bias = self._held.get(module) or self._hold(module)
            out = kernels.stored_step(x, bits, l1, part, peaks, bits, runs)
            if bias is not None:
                out = out + bias
            outs.append(out.astype(np.float32))
        return outs

    def _hold(self, module) -> tuple:
        """What a step's product of ``module`` reads, looked up once a process: its stored
        weight (the canary's step check run for its kind first), row peaks and run bounds,
        and fp64 bias.
        Norms likewise: their fp32 weight and epsilon."""
        if isinstance(module, torch.nn.Linear):
            part = self.weights.stored(module.weight)
            self.weights.before_step(part.kind.name, self.form)
            bias = module.bias
            bias = None if bias is None else bias.detach().numpy().astype(np.float64)
            held = (part, self.weights.peaks(part), self.weights.runs(part), bias)
        else:
            held = (module.weight.detach().numpy(), np.float32(module.variance_epsilon))
        self._held[module] = held
        return held

    def _native_norm(self, x: np.ndarray, module) -> np.ndarray:
        weight, eps = self._held.get(module) or self._hold(module)
        rows = x.reshape(-1, x.shape[-1])
        return kernels.rms_norm(np.ascontiguousarray(rows), weight, eps).reshape(x.shape)

    def _native_attention(self, layer, attn, x, cos, sin, states) -> np.ndarray:
        rows, hd = x.shape[0], attn.head_dim
        q, k, v = (
            p.reshape(rows, -1, hd)
            for p in self._native_linear(x, attn.q_proj, attn.k_proj, attn.v_proj)
        )
        if hasattr(attn, "q_norm"):
            q, k = self._native_norm(q, attn.q_norm), self._native_norm(k, attn.k_norm)
        window = self._window(attn)
        out = np.empty((rows, q.shape[1] * hd), dtype=np.float32)
        for row, state in enumerate(states):
            att = kernels.step_attention(
                q[row], k[row], v[row], cos[row], sin[row], state, layer, window, attn.scaling
            )
            out[row] = att.reshape(-1)  # rounded to fp32, as the torch path's .to(q.dtype)
        return self._native_linear(out, attn.o_proj)[0]

    def steps_natively(self) -> bool:
        """Whether `step` can run this model: every linear weight held in the store, in a
        one-integer form (v2's two limbs keep the torch path)."""
        linears = [m for m in self.model.modules() if isinstance(m, torch.nn.Linear)]
        held = all(self.weights.stored(m.weight) is not None for m in linears)
        return kernels.enabled() and self.form != exact.PEAK2 and held

    def step(self, states, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """`run` for one token a row (ids, positions (batch, 1)): the same logits and K/V."""
        h = self.weights.embedding(self.base.embed_tokens.weight, ids[:, 0]).numpy()
        cos, sin = (t[:, 0].numpy() for t in self._rotary(positions))
        for layer, block in enumerate(self.base.layers[: self.cfg.num_hidden_layers]):
            x = self._native_norm(h, block.input_layernorm)
            h = h + self._native_attention(layer, block.self_attn, x, cos, sin, states)
            x = self._native_norm(h, block.post_attention_layernorm)
            gate, up = self._native_linear(x, block.mlp.gate_proj, block.mlp.up_proj)
            h = h + self._native_linear(kernels.silu_product(gate, up), block.mlp.down_proj)[0]
        h = self._native_norm(h, self.base.norm)
        return torch.from_numpy(self._native_linear(h, self.model.lm_head)[0])[:, None, :]

    @torch.inference_mode()
    def run(self, states, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Logits (batch, seq, vocab) for ids (batch, seq) at positions; writes each row's K/V."""
        if ids.shape[1] == 1 and self.native_step and kernels.usable(ids):
            return self.step(states, ids, positions)
        h = self.weights.embedding(self.base.embed_tokens.weight, ids)
        cos, sin = self._rotary(positions)
        for layer, block in enumerate(self.base.layers[: self.cfg.num_hidden_layers]):
            x = self._rms_norm(h, block.input_layernorm)
            h = h + self._attention(layer, block.self_attn, x, cos, sin, states)
            x = self._rms_norm(h, block.post_attention_layernorm)
            h = h + self._mlp(block.mlp, x)
        h = self._rms_norm(h, self.base.norm)
        return self._linear(h, self.model.lm_head)[0]
