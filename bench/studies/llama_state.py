"""llama.cpp saved states into one archive: a 20-slot llama-server directory, sizes and times.

llama.cpp (llama-cpp-python, the `llamacpp` extra) runs the embedded GGUF as llama-server would
(flash attention on, f16 cache): each of 20 slots holds the same system prompt (a sample_data
chat's), its own user message and a 24-token greedy reply, and is saved as llama-server's
`/slots?action=save` writes it (a sequence state, packed token list). Then:

* `seqkv import llama-state` exact (llama.cpp's own K/V) and `--tokens-only`, sizes and times;
* `seqkv export llama-state` of every slot from the exact archive: each must equal its file
  byte for byte (the bench stops otherwise), and one tokens-only export is timed.

`--agent`: instead, the agent transcript of docs/AGENT_MEMORY.md turn by turn (the same token
ids as bench/studies/agent_memory.py): llama.cpp's state file of each turn next to the archive that
imports each turn's state as it comes (exact and tokens only).

    python -m bench.studies.llama_state --json bench/results/llama_state.json \\
        --append docs/BENCHMARKS_LOG.md
    python -m bench.studies.llama_state --agent --json bench/results/llama_state_agent.json
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from bench import harness
from bench.harness import SAMPLE
from bench.table import table

REPLY_TOKENS = 24


def _slots(n: int) -> list[tuple[str, str]]:
    chats = [json.loads(line) for line in (SAMPLE / "chats.jsonl").read_text().splitlines()]
    system = chats[0]["messages"][0]["content"]
    users = [m["content"] for c in chats for m in c["messages"] if m["role"] == "user"]
    return [
        (system, users[i % len(users)] + ("" if i < len(users) else f" ({i})")) for i in range(n)
    ]


def _chatml(system: str, user: str) -> str:
    return (
        f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def _llama():
    """llama.cpp on the embedded GGUF as llama-server runs it on CPU (flash attention on)."""
    import llama_cpp

    from seqkv_cli.runtime.embedded import embedded_gguf

    return llama_cpp.Llama(
        model_path=str(embedded_gguf()), n_ctx=2048, n_threads=2, verbose=False, flash_attn=True
    )


def _save_state(llm, tokens: list[int], path: Path) -> None:
    """The context's cache saved as llama-server saves a slot (packed token list)."""
    import llama_cpp

    words = [-1, 1, len(tokens), *tokens, 0]
    arr = (llama_cpp.llama_token * len(words))(*words)
    assert llama_cpp.llama_state_seq_save_file(llm._ctx.ctx, str(path).encode(), 0, arr, len(words))


def save_slots(folder: Path, n: int) -> list[Path]:
    import llama_cpp
    import numpy as np

    llm = _llama()
    paths = []
    for i, (system, user) in enumerate(_slots(n)):
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(llm._ctx.ctx), True)
        llm.reset()
        tokens = llm.tokenize(_chatml(system, user).encode(), add_bos=False, special=True)
        llm.eval(tokens)
        for _ in range(REPLY_TOKENS):  # greedy reply, fed back as the server does
            ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
            nxt = int(np.argmax(np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),))))
            tokens.append(nxt)
            llm.eval([nxt])
        path = folder / f"slot{i:02d}.bin"
        _save_state(llm, tokens, path)
        paths.append(path)
    return paths


def agent(lm, args) -> None:
    import llama_cpp

    from bench.studies.agent_memory import bf16_cache_bytes, turns
    from seqkv_cli.llamacpp.transfer import import_states

    llm = _llama()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for k, ids in enumerate(turns(lm.tokenizer, args.max_tokens), 1):
            path = folder / f"turn-{k:02d}.bin"
            llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(llm._ctx.ctx), True)
            llm.reset()
            llm.eval(ids)
            _save_state(llm, ids, path)
            start = time.perf_counter()
            exact = import_states([path], folder / "exact.skv", model=lm)
            seconds = time.perf_counter() - start
            plain = import_states([path], folder / "tokens.skv", model=lm, tokens_only=True)
            rows.append(
                {
                    "turn": k,
                    "tokens": len(ids),
                    "llama_state_bytes": path.stat().st_size,
                    "exact_file_bytes": exact.file_bytes,
                    "tokens_only_file_bytes": plain.file_bytes,
                    "bf16_last_cache_bytes": bf16_cache_bytes(lm, len(ids)),
                    "import_exact_seconds": round(seconds, 1),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    result = {"environment": harness.environment(lm), "command": harness.command_line()}
    result["turns"] = rows
    head = [
        "turn", "tokens", "llama.cpp state file (this turn)", "seqkv exact, all turns so far",
        "seqkv tokens only, all turns so far", "bf16 cache (this turn)", "import (exact)",
    ]  # fmt: skip
    cells = [
        [r["turn"], f"{r['tokens']:,}", f"{r['llama_state_bytes']:,} B",
         f"{r['exact_file_bytes']:,} B", f"{r['tokens_only_file_bytes']:,} B",
         f"{r['bf16_last_cache_bytes']:,} B", f"{r['import_exact_seconds']} s"]
        for r in rows
    ]  # fmt: skip
    title = "llama.cpp's state of each agent turn (`bench/studies/llama_state.py --agent`)"
    lines = [*harness.heading(title, result), *table(head, cells, align="rrrrrrr")]
    harness.publish(result, "\n".join(lines), args.json, args.append)


def main(argv: list[str] | None = None) -> None:
    # no --model: llama.cpp runs the embedded model's own GGUF
    parser = harness.parser(__doc__, model=False)
    parser.add_argument("--slots", type=int, default=20)
    parser.add_argument("--agent", action="store_true")
    parser.add_argument(
        "--exports", type=int, default=1, help="slots exported and compared, from the last"
    )
    parser.add_argument("--max-tokens", type=int, default=600)
    args = parser.parse_args(argv)
    harness.start(args)

    from seqkv_cli.llamacpp.transfer import export_state, import_states
    from seqkv_cli.runtime.loading import load_model

    lm = load_model()
    if args.agent:
        agent(lm, args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "slots").mkdir()
        start = time.perf_counter()
        paths = save_slots(folder / "slots", args.slots)
        saved_s = time.perf_counter() - start
        state_bytes = sum(p.stat().st_size for p in paths)
        start = time.perf_counter()
        exact = import_states(paths, folder / "exact.skv", model=lm)
        exact_s = time.perf_counter() - start
        start = time.perf_counter()
        tokens_only = import_states(paths, folder / "tokens.skv", model=lm, tokens_only=True)
        tokens_s = time.perf_counter() - start
        start = time.perf_counter()
        # The last slot's residual rests on the first one's: its export decodes both.
        checked = list(zip(paths, exact.states, strict=True))[-args.exports :]
        for p, s in checked:
            out = folder / f"{s.id}.out"
            export_state(folder / "exact.skv", s.id, out, model=lm)
            if out.read_bytes() != p.read_bytes():
                raise SystemExit(f"{s.id}: exported state differs from llama.cpp's file")
        export_s = time.perf_counter() - start
        start = time.perf_counter()
        export_state(folder / "tokens.skv", exact.states[0].id, folder / "t.out", model=lm)
        export_tokens_s = time.perf_counter() - start
    positions = sum(s.tokens for s in exact.states)
    rel = [s.relative_difference for s in exact.states]
    result = {
        "environment": harness.environment(lm),
        "command": harness.command_line(),
        "slots": args.slots,
        "positions": positions,
        "state_bytes": state_bytes,
        "exact_bytes": exact.file_bytes,
        "tokens_only_bytes": tokens_only.file_bytes,
        "exact_ratio": state_bytes / exact.file_bytes,
        "tokens_only_ratio": state_bytes / tokens_only.file_bytes,
        "exact_bits_per_position": 8 * exact.file_bytes / positions,
        "tokens_only_bits_per_position": 8 * tokens_only.file_bytes / positions,
        "relative_difference": {"min": min(rel), "max": max(rel)},
        "seconds": {
            "llama_cpp_save_all": saved_s,
            "import_exact": exact_s,
            "import_tokens_only": tokens_s,
            "export_exact": export_s,
            "exports_checked": len(checked),
            "export_tokens_only_one": export_tokens_s,
        },
    }
    cells = [
        [f"llama.cpp state files ({args.slots}, {positions:,} positions, f16 K/V)",
         f"{state_bytes:,}", "1.00", f"{8 * state_bytes / positions:,.0f}"],
        ["seqkv exact (llama.cpp's own K/V, bit for bit)", f"{exact.file_bytes:,}",
         f"{result['exact_ratio']:.2f}", f"{result['exact_bits_per_position']:,.0f}"],
        ["seqkv tokens only (llama.cpp re-prefills)", f"{tokens_only.file_bytes:,}",
         f"{result['tokens_only_ratio']:,.0f}", f"{result['tokens_only_bits_per_position']:.2f}"],
    ]  # fmt: skip
    head = ["stored as", "bytes", "ratio vs the state files", "bits/position"]
    text = "\n".join(
        [
            *harness.heading(
                f"llama.cpp slot states: {args.slots} llama-server slots in one archive", result
            ),
            *table(head, cells, align="lrrr"),
            "",
            f"Import: exact {exact_s:.1f} s, tokens only {tokens_s:.1f} s; export of the last "
            f"{len(checked)} exact slot(s) {export_s:.1f} s (byte-identical to llama.cpp's "
            f"file), one tokens-only export {export_tokens_s:.1f} s; llama.cpp saved "
            f"the {args.slots} slots in {saved_s:.1f} s. llama.cpp's K/V are "
            f"{100 * min(rel):.1f}-{100 * max(rel):.1f} % (relative) from seqkv's fp32 "
            "recompute of the Q4_1 GGUF.",
        ]
    )
    harness.publish(result, text, args.json, args.append)


if __name__ == "__main__":
    main()
