"""A memory's load time in each load mode, against a warm transformers prefill of its tokens.

One session of N tokens (the sample prose, code, agent transcript and chats, in that order)
kept through the library API three ways: tokens only in load mode "small" (`seq`: coded under
the model, a load steps it once a token), tokens only in mode "fast" (`seq-fast`: the tokens
without the model, a load is one canonical prefill), and with the user's own cache (one
prefill, kept by replay) in mode "fast" (a load reads the tokens and re-runs the user's model:
no seqkv forward at all). Each `load` is timed in the process that already holds the model,
against the best of two warm transformers prefills of the same tokens in the same process;
every load is checked bit for bit (tokens-only loads against each other, the replayed one
against the user's cache).

    python -m bench.studies.load_modes --tokens 4000 --json bench/results/load_modes.json
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

from bench import harness
from bench.harness import SAMPLE, best_of, timed
from bench.table import table

TEXTS = ("prose.txt", "sample_code.py", "agent_transcript.jsonl", "chats.jsonl")


def sample_ids(tokenizer, n: int) -> torch.Tensor:
    """The first `n` token ids of the sample texts, each tokenized on its own, joined."""
    ids: list[int] = []
    for name in TEXTS:
        ids += tokenizer((SAMPLE / name).read_text()).input_ids
        if len(ids) >= n:
            return torch.tensor([ids[:n]])
    raise SystemExit(f"the sample texts hold {len(ids)} tokens, fewer than {n}")


def main(argv: list[str] | None = None) -> dict:
    parser = harness.parser(__doc__)
    parser.add_argument("--tokens", type=int, default=4000)
    args = parser.parse_args(argv)
    import seqkv_cli as seqkv

    lm = harness.start(args)
    model = lm.fp32_model()
    ids = sample_ids(lm.tokenizer, args.tokens)
    with torch.inference_mode():
        model(ids[:, :64])  # warm: the first call pays for allocations
        cache, prefill_s = best_of(lambda: model(ids, use_cache=True).past_key_values, 2)
    rows, loaded = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, mode, own in (
            ("tokens only, small", "small", False),
            ("tokens only, fast", "fast", False),
            ("own cache (replay), fast", "fast", True),
        ):
            path = Path(tmp) / f"{mode}-{own}.skv"
            with seqkv.open_archive(path, model=lm, load=mode) as arc:
                kept = cache if own else None
                report, add_s = timed(lambda arc=arc, kept=kept: arc.add("memory", ids, cache=kept))
                got, load_s = timed(lambda arc=arc: arc.load("memory"))
            loaded[name] = got
            rows.append(
                {
                    "archive": name,
                    "tokens": ids.shape[1],
                    "file_bytes": report.file_bytes,
                    "kv_strategy": report.kv_strategy,
                    "add_seconds": round(add_s, 2),
                    "load_seconds": round(load_s, 2),
                    "load_over_prefill": round(load_s / prefill_s, 2),
                    "ms_per_token": round(1000 * load_s / ids.shape[1], 2),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    small, fast = loaded["tokens only, small"], loaded["tokens only, fast"]
    replayed = loaded["own cache (replay), fast"]
    exact = {
        "fast_equals_small": _same(small, fast),
        "replay_equals_own_cache": _same(replayed, cache),
    }
    if not all(exact.values()):
        raise SystemExit(f"a load was not bit-exact: {exact}")
    return harness.finish(
        args, lm, markdown, rows=rows, prefill_seconds=round(prefill_s, 2), exact=exact
    )


def _same(a, b) -> bool:
    return all(
        torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values)
        for x, y in zip(a.layers, b.layers, strict=True)
    )


def markdown(result: dict) -> str:
    rows = result["rows"]
    return "\n".join(
        [
            *harness.heading(
                "A memory's load time by load mode (`bench/studies/load_modes.py`)", result
            ),
            f"A warm transformers prefill of the same {rows[0]['tokens']:,} tokens in the same "
            f"process: {result['prefill_seconds']} s. Every load bit-exact: "
            + ", ".join(f"{k} {v}" for k, v in result["exact"].items())
            + ".",
            "",
            *table(
                ["archive", "file", "add", "load", "load / prefill", "ms / token"],
                [
                    [
                        r["archive"],
                        f"{r['file_bytes']:,} B",
                        f"{r['add_seconds']} s",
                        f"{r['load_seconds']} s",
                        f"{r['load_over_prefill']} x",
                        r["ms_per_token"],
                    ]
                    for r in rows
                ],
            ),
            "",
        ]
    )


if __name__ == "__main__":
    main()
