"""The token coder on a device: the canonical forward on CUDA, many sessions as rows.

No weights are downloaded on a lent machine: the model is the embedded model's *shape*
(SmolLM2-135M: 30 layers, 9 query / 3 KV heads of 64, MLP 1536, vocab 49,152) with seeded
random weights, handed to `CanonicalLM` through a minimal stand-in for a transformers model.
Speed does not depend on weight values; byte identity is checked on what these weights give.

GPU kernels are not promised to be row-invariant (docs/NUMERICS.md covers the CPU BLAS), so
the streams are encoded from a teacher-forced pass in exactly the decoder's lockstep shape
(every session one row of the same forward_rows calls): the decode is then exact by
construction, and the timing is that of a real decode.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import torch

SMOLLM2 = {"layers": 30, "hidden": 576, "heads": 9, "kv_heads": 3, "mlp": 1536, "vocab": 49152}
TINY = {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "mlp": 128, "vocab": 4096}


def stand_in(shape: dict, device: str, seed: int = 0) -> SimpleNamespace:
    """What `CanonicalLM(hf_model)` reads from a transformers Llama: config, weights, RoPE."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    h, hd = shape["hidden"], shape["hidden"] // shape["heads"]

    def w(*size: int) -> torch.Tensor:
        # made on the CPU (the generator's device) even inside a `with torch.device(...)`
        return (torch.randn(*size, generator=gen, device="cpu") * size[-1] ** -0.5).to(device)

    p = {"model.embed_tokens.weight": w(shape["vocab"], h), "model.norm.weight": w(h) + 1}
    for i in range(shape["layers"]):
        pre = f"model.layers.{i}."
        p |= {
            pre + "input_layernorm.weight": w(h) + 1,
            pre + "post_attention_layernorm.weight": w(h) + 1,
            pre + "self_attn.q_proj.weight": w(h, h),
            pre + "self_attn.k_proj.weight": w(shape["kv_heads"] * hd, h),
            pre + "self_attn.v_proj.weight": w(shape["kv_heads"] * hd, h),
            pre + "self_attn.o_proj.weight": w(h, h),
            pre + "mlp.gate_proj.weight": w(shape["mlp"], h),
            pre + "mlp.up_proj.weight": w(shape["mlp"], h),
            pre + "mlp.down_proj.weight": w(h, shape["mlp"]),
        }
    config = SimpleNamespace(
        model_type="llama", hidden_act="silu", num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"], head_dim=hd,
        hidden_size=h, vocab_size=shape["vocab"], max_position_embeddings=8192, rms_norm_eps=1e-5,
    )  # fmt: skip
    inv_freq = 1.0 / (100000.0 ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    rotary = SimpleNamespace(inv_freq=inv_freq.to(device), attention_scaling=1.0)
    return SimpleNamespace(
        config=config, model=SimpleNamespace(rotary_emb=rotary), state_dict=p.copy
    )


class DeviceRows:
    """A `LogitsModel` running `CanonicalLM` on `device`; logits come back as host float32."""

    def __init__(self, shape: dict, device: str) -> None:
        from seqkv_cli.runtime.legacy import CanonicalLM

        self.device = torch.device(device)
        with self.device:
            self.canon = CanonicalLM(stand_in(shape, device))
        self.vocab_size = self.canon.vocab_size

    def start(self, capacity: int):
        with self.device:
            return self.canon.new_state(capacity)

    def feed(self, state, token_ids: np.ndarray) -> np.ndarray:
        with self.device:
            ids = torch.as_tensor(np.asarray(token_ids, dtype=np.int64), device=self.device)
            return self.canon.forward(state, ids).float().cpu().numpy()

    def feed_rows(self, states: list, token_ids: np.ndarray) -> np.ndarray:
        with self.device:
            logits = self.canon.forward_rows(states, [int(t) for t in token_ids])
        return logits.float().cpu().numpy()


class _Replay:
    """Stored logits rows of one session, fed back to the token coder's encoder."""

    def __init__(self, rows: np.ndarray) -> None:
        self.rows, self.vocab_size = rows, rows.shape[1]

    def start(self, capacity: int) -> list[int]:
        return [0]

    def feed(self, state: list[int], token_ids: np.ndarray) -> np.ndarray:
        first = state[0]
        state[0] += len(token_ids)
        return self.rows[first : state[0]]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def token_coder(shape: dict, device: str, sessions: int, tokens: int, seed: int = 0) -> dict:
    """Encode `sessions` random sessions (teacher-forced lockstep), decode them in lockstep."""
    from seqkv_codecs.sequential import encode_tokens, frequencies_from_logits_torch
    from seqkv_codecs.sequential.batch_decode import decode_tokens_batch

    model = DeviceRows(shape, device)
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, model.vocab_size, (sessions, tokens))
    model.feed_rows([model.start(2) for _ in range(sessions)], ids[:, 0])  # warm-up
    states = [model.start(tokens) for _ in range(sessions)]
    rows = np.zeros((sessions, tokens - 1, model.vocab_size), dtype=np.float32)
    _sync(model.device)
    start = time.perf_counter()
    for j in range(tokens - 1):  # exactly the decoder's calls: one row per session per step
        rows[:, j] = model.feed_rows(states, ids[:, j])
    forced = time.perf_counter() - start
    streams = [encode_tokens(ids[s], _Replay(rows[s])) for s in range(sessions)]
    start = time.perf_counter()
    decoded = decode_tokens_batch(streams, model)
    decode_s = time.perf_counter() - start
    exact = sum(
        isinstance(d, np.ndarray) and np.array_equal(d, i)
        for d, i in zip(decoded, ids, strict=True)
    )
    with model.device:
        logits = torch.as_tensor(rows[:, -1], device=model.device)
        frequencies_from_logits_torch(logits)  # warm-up (table upload)
        _sync(model.device)
        start = time.perf_counter()
        frequencies_from_logits_torch(logits)
        _sync(model.device)
        tables_s = time.perf_counter() - start
    step_s = forced / (tokens - 1)
    return {
        "device": str(model.device),
        "sessions": sessions,
        "tokens_per_session": tokens,
        "sessions_decoded_exactly": int(exact),
        "decode_tokens_per_s": sessions * (tokens - 1) / decode_s,
        "forward_rows_step_s": step_s,
        "device_tables_step_s": tables_s,
        "ceiling_tokens_per_s": sessions / (step_s + tables_s),
    }
