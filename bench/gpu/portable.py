"""The portable forward on a device against the same forward on the CPU, in one process.

A step of bench/gpu/check.py: a transformers Llama with the embedded model's shape and seeded
random weights (no weights need to be on the machine) runs through `PortableLM` on the CPU and
on the device: a prefill, then token-by-token steps, then rows of sibling sessions stepped as
one forward. Logits and every K/V tensor must be the same bits on both; the times are set
next to a transformers fp32 DynamicCache step on the same device (the engine a user would run
instead).
"""

from __future__ import annotations

import copy
import time

import torch

from bench.table import table


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_llama(shape: dict, seed: int = 0):
    """A random transformers Llama of `shape` (bench/gpu/tokens.py's keys), fp32, eval mode:
    tests/conftest.py's family builder, at the embedded model's shape."""
    from bench.gpu.files import shape_config, tests_conftest

    config = {**shape_config(shape), "tie_word_embeddings": True}  # as the embedded model
    return tests_conftest().tiny_family_model("llama", seed=seed, **config).float()


def _run(lm, ids: torch.Tensor, prefill: int) -> dict:
    """Prefill, then step one token at a time; logits, K/V and seconds."""
    device = lm.device
    state = lm.new_state(len(ids))
    _sync(device)
    start = time.perf_counter()
    logits = [lm.forward(state, ids[:prefill])]
    _sync(device)
    prefill_s = time.perf_counter() - start
    start = time.perf_counter()
    for i in range(prefill, len(ids)):
        logits.append(lm.forward(state, ids[i : i + 1]))
    _sync(device)
    step_s = (time.perf_counter() - start) / max(len(ids) - prefill, 1)
    keys, values = zip(*(state.layer_kv(i) for i in range(lm.num_layers)), strict=True)
    return {
        "logits": torch.cat(logits),
        "kv": [t.clone() for t in (*keys, *values)],
        "prefill_s": prefill_s,
        "step_s": step_s,
    }


def _rows_step(lm, rows: int, context: int, steps: int = 4) -> float:
    """Seconds of one `forward_rows` call over `rows` sessions at `context` positions."""
    ids = torch.arange(context) % lm.vocab_size
    base = lm.new_state(context + steps)
    lm.forward(base, ids)
    states = [base.fork(context, context + steps) for _ in range(rows)]
    lm.forward_rows(states, [1] * rows)  # warm-up
    _sync(lm.device)
    start = time.perf_counter()
    for t in range(steps - 1):
        lm.forward_rows(states, [(t + r) % lm.vocab_size for r in range(rows)])
    _sync(lm.device)
    return (time.perf_counter() - start) / (steps - 1)


@torch.inference_mode()
def _transformers_step(model, ids: torch.Tensor, prefill: int) -> float:
    from transformers import DynamicCache

    from seqkv_cli.runtime.hfcompat import forward_with_cache

    device = next(model.parameters()).device
    ids = ids.to(device)
    _, cache = forward_with_cache(model, ids[None, :prefill], DynamicCache())
    _sync(device)
    start = time.perf_counter()
    for i in range(prefill, len(ids)):
        _, cache = forward_with_cache(model, ids[None, i : i + 1], cache)
    _sync(device)
    return (time.perf_counter() - start) / max(len(ids) - prefill, 1)


def portable_forward(
    shape: dict, device: str, prefill: int, steps: int, rows: tuple[int, ...]
) -> dict:
    from seqkv_cli.runtime.portable.model import PortableLM

    model = build_llama(shape)
    on_device = copy.deepcopy(model).to(device)
    ids = torch.randint(0, shape["vocab"], (prefill + steps,), generator=torch.Generator())
    cpu, dev = PortableLM(model), PortableLM(on_device)
    a, b = _run(cpu, ids, prefill), _run(dev, ids, prefill)
    same = lambda x, y: bool(torch.equal(x.view(torch.int32), y.view(torch.int32)))  # noqa: E731
    return {
        "device": device,
        "numeric_path": cpu.numeric_path,
        "shape": shape,
        "prefill_tokens": prefill,
        "steps": steps,
        "logits_bit_identical": same(a["logits"], b["logits"]),
        "kv_bit_identical": all(same(x, y) for x, y in zip(a["kv"], b["kv"], strict=True)),
        "fused_decoder_on_device": dev.fused is not None,
        "cpu_prefill_s": a["prefill_s"],
        "device_prefill_s": b["prefill_s"],
        "cpu_step_s": a["step_s"],
        "device_step_s": b["step_s"],
        "device_transformers_step_s": _transformers_step(on_device, ids, prefill),
        "device_rows_step_s": {str(r): _rows_step(dev, r, prefill) for r in rows},
    }


def markdown(r: dict) -> list[str]:
    dev = r["device"]
    ok = "yes" if r["logits_bit_identical"] and r["kv_bit_identical"] else "**NO**"
    lines = [
        "",
        f"Portable forward (`{r['numeric_path']}`) on the CPU and on {dev}, random weights, shape "
        f"{r['shape']}: {r['prefill_tokens']}-token prefill then {r['steps']} steps; logits and "
        f"K/V bit-identical: {ok} (fused decoder on the device: {r['fused_decoder_on_device']}).",
        "",
    ]
    cells = [
        ["prefill, s", f"{r['cpu_prefill_s']:.3f}", f"{r['device_prefill_s']:.3f}"],
        ["one-token step, ms", f"{r['cpu_step_s'] * 1e3:.1f}", f"{r['device_step_s'] * 1e3:.1f}"],
        ["transformers fp32 DynamicCache step, ms", "",
         f"{r['device_transformers_step_s'] * 1e3:.1f}"],
        *([f"{rows} sessions as rows, one step, ms (tokens/s)", "",
           f"{s * 1e3:.1f} ({int(rows) / s:,.0f})"]
          for rows, s in r["device_rows_step_s"].items()),
    ]  # fmt: skip
    return lines + table(["measurement", "CPU", "device"], cells, align="lrr")
