"""Agent memory on disk: an agent transcript appended turn by turn through the library API.

Each turn is `arc.add` of the whole session so far (ids of the chat template over the
messages up to that turn) into three archives: tokens-only (K/V recomputed on load), the
agent's own cache by replay (the default: a transformers fp32 forward stored as bf16, which
the same model reproduces), and the same cache as a portable residual (`residual="lossless"`,
bit for bit on any machine). Reported per turn: tokens, bytes on disk of each archive, and
what the same turns cost as bf16 caches (one per turn, as a naive store keeps them, and the
last one alone). The last turn is then loaded back from each archive (timed; `load` decodes
the token stream by stepping the model once per token) and compared bit for bit.

    python -m bench.studies.agent_memory --max-tokens 600 --append docs/BENCHMARKS_LOG.md
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

from bench import harness
from bench.harness import SAMPLE, timed
from bench.table import table


def turns(tokenizer, max_tokens: int) -> list[list[int]]:
    """Token ids of the transcript after each message, while within `max_tokens`."""
    record = json.loads((SAMPLE / "agent_transcript.jsonl").read_text().splitlines()[0])
    messages, out = record["messages"], []
    for k in range(2, len(messages) + 1):
        ids = tokenizer.apply_chat_template(messages[:k], tokenize=True)
        ids = list(getattr(ids, "input_ids", ids))
        if len(ids) > max_tokens:
            break
        if out and ids[: len(out[-1])] != out[-1]:
            raise SystemExit("the chat template does not render a turn as a prefix of the next")
        out.append(ids)
    if not out:
        raise SystemExit(f"the first two messages exceed {max_tokens} tokens")
    return out


def bf16_cache_bytes(lm, n: int) -> int:
    return 2 * lm.num_layers * lm.num_kv_heads * lm.head_dim * n * 2


def own_cache(model, ids: list[int]):
    with torch.inference_mode():
        cache = model(torch.tensor([ids]), use_cache=True).past_key_values
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys.bfloat16(), layer.values.bfloat16()
    return cache


def main(argv: list[str] | None = None) -> dict:
    parser = harness.parser(__doc__)
    parser.add_argument("--max-tokens", type=int, default=600)
    args = parser.parse_args(argv)
    import seqkv_cli as seqkv

    lm = harness.start(args)
    sessions = turns(lm.tokenizer, args.max_tokens)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        plain = seqkv.open_archive(folder / "tokens.skv", model=lm)
        replayed = seqkv.open_archive(folder / "replay.skv", model=lm)
        exact = seqkv.open_archive(folder / "own-cache.skv", model=lm)
        naive = 0
        last_cache = None
        for k, ids in enumerate(sessions, 1):
            sid = f"agent-01/turn-{k:02d}"
            a = plain.add(sid, ids)
            last_cache = own_cache(lm.model, ids)
            r = replayed.add(sid, ids, cache=last_cache)
            if r.kv != "replay":
                raise SystemExit(f"turn {k}: replay did not reproduce the cache ({r.note})")
            b = exact.add(sid, ids, cache=last_cache, residual="lossless")
            naive += bf16_cache_bytes(lm, len(ids))
            rows.append(
                {
                    "turn": k,
                    "tokens": len(ids),
                    "new_tokens": a.new_tokens,
                    "tokens_only_file_bytes": a.file_bytes,
                    "replay_file_bytes": r.file_bytes,
                    "own_cache_file_bytes": b.file_bytes,
                    "bf16_caches_bytes": naive,
                    "bf16_last_cache_bytes": bf16_cache_bytes(lm, len(ids)),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
        last = f"agent-01/turn-{len(sessions):02d}"
        loaded_plain, plain_s = timed(lambda: plain.load(last))
        loaded_replay, replay_s = timed(lambda: replayed.load(last))
        loaded_exact, exact_s = timed(lambda: exact.load(last))
        same = all(
            torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values)
            for loaded in (loaded_replay, loaded_exact)
            for x, y in zip(last_cache.layers, loaded.layers, strict=True)
        )
        if not same:
            raise SystemExit("an own-cache archive did not give the cache back bit for bit")
        if loaded_plain.get_seq_length() != len(sessions[-1]):
            raise SystemExit("the tokens-only archive restored the wrong length")
    n = len(sessions[-1])
    restore = {
        "tokens": n,
        "tokens_only_seconds": round(plain_s, 1),
        "replay_seconds": round(replay_s, 1),
        "own_cache_seconds": round(exact_s, 1),
        "own_cache_bit_exact": same,
    }
    return harness.finish(args, lm, markdown, turns=rows, restore=restore)


def markdown(result: dict) -> str:
    rows, rest = result["turns"], result["restore"]
    lines = [
        *harness.heading(
            "Agent memory through the library API (`bench/studies/agent_memory.py`)", result
        ),
        *table(
            [
                "turn",
                "tokens",
                "seqkv tokens-only",
                "seqkv own cache, replay",
                "seqkv own cache, portable residual",
                "bf16 cache per turn (all turns)",
                "bf16 cache (last turn)",
            ],
            [
                [
                    r["turn"],
                    f"{r['tokens']:,}",
                    f"{r['tokens_only_file_bytes']:,} B",
                    f"{r['replay_file_bytes']:,} B",
                    f"{r['own_cache_file_bytes']:,} B",
                    f"{r['bf16_caches_bytes']:,} B",
                    f"{r['bf16_last_cache_bytes']:,} B",
                ]
                for r in rows
            ],
            align="rrrrrrr",
        ),
    ]
    lines += [
        "",
        f"Loading the last turn ({rest['tokens']:,} tokens): tokens-only "
        f"{rest['tokens_only_seconds']} s, replay {rest['replay_seconds']} s, portable "
        f"residual {rest['own_cache_seconds']} s (own cache bit for bit: "
        f"{rest['own_cache_bit_exact']}). Every load decodes the token stream by stepping the "
        "canonical forward once per token; replay then runs one transformers prefill.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
