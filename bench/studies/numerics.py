"""Portable (v2, v1) vs legacy numerics on the embedded model: bits, K/V error, speed.

    python -m bench.studies.numerics --threads 2 [--sections texts,speed] [--json out.json]
    python -m bench.studies.numerics --generic-weights --sections texts   # fp32 weights off the
                                                                          # Q4 grid (below)

* bits: token cross-entropy under each path vs the float model (transformers eager fp32) on
  sample_data texts of >= 1,000 tokens (prose + code, and the agent snapshots);
* K/V error of each canonical path vs an ordinary transformers fp32 forward (max relative),
  and the share of bf16 K/V elements that differ from the model run in float64;
* speed: prefill of 256 tokens, one-token steps (median of 24), 8 sequences stepped as rows.

--generic-weights multiplies every weight matrix by (1 + 0.02·N(0, 1)) (seeded): the
embedded model's weights come from a 4-bit GGUF and sit on a coarse grid, which flatters a
definition's weight bits; ordinary fp32 or bf16 checkpoints do not.
Run it alone: on 2 cores a neighbour's load is measured too.
"""

from __future__ import annotations

import copy
import json
import math
import statistics
import time

import torch

from bench import harness
from bench.harness import SAMPLE
from bench.table import table


def texts(lm) -> dict[str, torch.Tensor]:
    """Token ids of the texts measured: prose + code, and the last (longest) agent snapshot."""
    from seqkv_cli.kvcapture.engine import tokenize
    from seqkv_cli.kvcapture.inputs import read_inputs

    prose_code = (SAMPLE / "prose.txt").read_text() + "\n" + (SAMPLE / "sample_code.py").read_text()
    snapshot = read_inputs([str(SAMPLE / "agent_snapshots.jsonl")])[-1]
    return {
        "prose+code": torch.tensor(lm.tokenizer(prose_code).input_ids[:1200]),
        "agent snapshot": torch.tensor(tokenize(lm, snapshot)[:1200]),
    }


def bits_per_token(logits: torch.Tensor, ids: torch.Tensor) -> float:
    lp = torch.log_softmax(logits.double(), -1)[torch.arange(len(ids) - 1), ids[1:]]
    return float(-lp.mean() / math.log(2))


def float_logits_and_kv(model, ids):
    from transformers import DynamicCache

    from seqkv_cli.runtime.hfcompat import forward_with_cache

    with torch.no_grad():
        logits, cache = forward_with_cache(model, ids[None], DynamicCache())
    kv = [(layer.keys[0], layer.values[0]) for layer in cache.layers]
    return logits[0].float(), kv


def bf16_differing(kv, truth) -> float:
    """Share of K/V elements whose bf16 rounding differs from the float64 run's."""
    differ = total = 0
    for layer, ref in zip(kv, truth, strict=True):
        for got, want in zip(layer, ref, strict=True):
            differ += int((got.bfloat16() != want.bfloat16()).sum())
            total += got.numel()
    return differ / total


def speed(canon, ids) -> dict[str, float]:
    state = canon.new_state(len(ids) + 40)
    t = time.perf_counter()
    canon.forward(state, ids[:256])
    prefill = time.perf_counter() - t
    steps = []
    for i in range(256, 280):
        t = time.perf_counter()
        canon.forward(state, ids[i : i + 1])
        steps.append(time.perf_counter() - t)
    states = [canon.new_state(300) for _ in range(8)]
    for s in states:
        canon.forward(s, ids[:100])
    rows = []
    for i in range(8):
        t = time.perf_counter()
        canon.forward_rows(states, [int(ids[100 + i])] * 8)
        rows.append(time.perf_counter() - t)
    return {
        "prefill_256_s": prefill,
        "step_ms": 1000 * statistics.median(steps),
        "rows8_step_ms": 1000 * statistics.median(rows),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = harness.parser(__doc__, threads=2)
    parser.add_argument("--sections", default="texts,speed")
    parser.add_argument("--generic-weights", action="store_true")
    args = parser.parse_args(argv)
    sections = set(args.sections.split(","))
    from seqkv_cli.kvcapture.engine import canonical_model
    from seqkv_cli.runtime.numerics import LEGACY, PORTABLE, PORTABLE_V1, PORTABLE_V2

    lm = harness.start(args)
    if args.generic_weights:
        torch.manual_seed(0)
        with torch.no_grad():
            for p in lm.model.parameters():
                if p.dim() > 1:
                    p.mul_(1 + 0.02 * torch.randn_like(p))
    result: dict = {"threads": args.threads, "generic_weights": args.generic_weights}
    result |= {"texts": {}, "speed": {}}
    docs = texts(lm)
    for name, ids in docs.items() if "texts" in sections else ():
        ref_logits, ref_kv = float_logits_and_kv(lm.model, ids)
        _, truth = float_logits_and_kv(copy.deepcopy(lm.model).double(), ids)
        row = {"tokens": len(ids), "float": bits_per_token(ref_logits, ids)}
        row["fp32 bf16_differ_vs_fp64"] = bf16_differing(ref_kv, truth)
        for path in (PORTABLE, PORTABLE_V2, PORTABLE_V1, LEGACY):
            canon = canonical_model(lm, path)
            state = canon.new_state(len(ids))
            logits = torch.cat(
                [canon.forward(state, ids[s : s + 256]) for s in range(0, len(ids), 256)]
            )
            row[path] = bits_per_token(logits, ids)
            row[f"{path} kv_rel_err"] = max(
                float((state.layer_kv(i)[j] - ref_kv[i][j]).abs().max() / ref_kv[i][j].abs().max())
                for i in range(canon.num_layers)
                for j in (0, 1)
            )
            kv = [state.layer_kv(i) for i in range(canon.num_layers)]
            row[f"{path} bf16_differ_vs_fp64"] = bf16_differing(kv, truth)
        result["texts"][name] = row
        print(name, json.dumps(row), flush=True)
    ids = docs["prose+code"]
    for path in (LEGACY, PORTABLE_V1, PORTABLE_V2, PORTABLE) if "speed" in sections else ():
        result["speed"][path] = speed(canonical_model(lm, path), ids)
        print(path, json.dumps(result["speed"][path]), flush=True)
    return harness.finish(args, lm, markdown, **result)


def markdown(result: dict) -> str:
    """The raw numbers as one table: docs/BENCHMARKS_LOG.md's numerics tables are written from
    them by hand."""
    lines = [*harness.heading("Numeric paths: bits, K/V error, speed", result)]
    cells = [
        [section, case, k, f"{v:.6g}"]
        for section in ("texts", "speed")
        for case, row in result[section].items()
        for k, v in row.items()
    ]
    lines += table(["section", "case", "measurement", "value"], cells, align="lllr")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
