"""A foreign cache's residual: what `seq` stores for K/V the canonical path did not compute.

Each text is captured with the embedded model's ordinary transformers forward (float32
compute, `canonical=False`: the cache a user's own run produces) and stored as bf16, fp16 or
fp32. `seq` then stores the tokens and the residual that makes restore return that cache bit
for bit. Reported per case: the share of elements that differ from the canonical recompute,
the residual as written (`SKR2`, modelled on the recompute's rounding, where it is smaller)
against the context-free bit-pattern difference (`SKR1`, what seqkv wrote before), both in
bits per position, and the whole file. With `--verify` (default: the first case only), the
file is decoded and compared with the capture bit for bit before it is counted.

Then the other half of issue 14's target: a **bf16-compute** cache (the embedded model cast to
bfloat16, what a GPU user runs), which no residual against the canonical path can make small,
archived through the library API by replay (`arc.add(id, ids, cache=...)`, the default), and
loaded back on the same machine and compared bit for bit. Reported: the share of its elements
that differ from the canonical recompute, and the bits per position the replay record costs
beyond a tokens-only archive of the same ids (and beyond the token payload).

    python -m bench.studies.foreign_residual --json bench/results/foreign_residual.json \
        --append docs/BENCHMARKS_LOG.md
"""

from __future__ import annotations

from pathlib import Path

import torch

from bench import harness
from bench.harness import SAMPLE, timed
from bench.table import table

CASES = [
    ("prose.txt", "bf16"),
    ("prose.txt", "fp16"),
    ("prose.txt", "fp32"),
    ("sample_code.py", "bf16"),
]


def measure(lm, canon, text: str, dtype: str, tokens: int, folder: Path, verify: bool) -> dict:
    from seqkv_cli.archive import compress_captures, decompress, same_capture
    from seqkv_cli.container import open_container
    from seqkv_cli.kvcapture.api import capture
    from seqkv_cli.kvcapture.capture_file import load_capture
    from seqkv_cli.sequential.session_codec import kv_bits
    from seqkv_codecs.residual import encode_residual
    from seqkv_codecs.rounding_residual import rounded_bits

    [result] = capture(
        [str(SAMPLE / text)],
        model=lm,
        out=folder / "caps",
        dtype=dtype,
        canonical=False,
        max_tokens=tokens,
        truncate=True,
    )
    cap = load_capture(result.path)
    n = cap.positions
    state = canon.new_state(n)
    canon.forward(state, cap.tokens)
    differing = elements = plain = 0
    for layer in range(canon.num_layers):
        for kind, theirs in ((0, cap.keys[layer]), (1, cap.values[layer])):
            exact = state.layer_kv(layer)[kind].float().numpy()
            base = rounded_bits(exact, dtype)
            bits = kv_bits(theirs)
            differing += int((bits != base).sum())
            elements += bits.size
            if (bits != base).any():
                plain += len(encode_residual(bits, base))
    res, seconds = timed(
        lambda: compress_captures(
            [result.path], folder / "x.skv", codec="seq", model=lm, check=False, layout="trie"
        )
    )
    written = res.part_bytes.get("residual", 0)
    with open_container(folder / "x.skv") as reader:
        kinds = {
            reader.read_section(s.name)[:4].decode()
            for s in reader.sections
            if "residual." in s.name
        }
    if verify:
        [restored] = decompress(folder / "x.skv", folder / "dec", model=lm)
        if not same_capture(cap, load_capture(restored)):
            raise SystemExit(f"{text} {dtype}: the restore is not the capture")
    return {
        "text": text,
        "dtype": dtype,
        "positions": n,
        "log2_ppl": round(cap.log2_ppl, 4),
        "differing_share": round(differing / elements, 6),
        "residual_streams": sorted(kinds),
        "residual_bits_per_position": round(written * 8 / n, 1),
        "skr1_bits_per_position": round(plain * 8 / n, 1),
        "token_bits_per_position": round(res.part_bytes.get("tokens", 0) * 8 / n, 3),
        "file_bits_per_position": round(res.file_bytes * 8 / n, 1),
        "verified_bit_exact": verify,
        "compress_seconds": round(seconds, 1),
    }


def replay_case(lm, text: str, tokens: int, folder: Path) -> dict:
    import copy

    import seqkv_cli as seqkv
    from seqkv_cli.container import open_container

    half = copy.deepcopy(lm.model).to(torch.bfloat16)
    ids = lm.tokenizer((SAMPLE / text).read_text()).input_ids[:tokens]
    with torch.inference_mode():
        cache = half(torch.tensor([ids]), use_cache=True).past_key_values
    with seqkv.open_archive(folder / "tokens.skv", model=half) as arc:
        plain = arc.add(text, ids)
    (report, seconds) = timed(lambda: _add_replayed(folder / "replay.skv", half, text, ids, cache))
    with seqkv.open_archive(folder / "replay.skv", model=half) as arc:
        loaded, load_seconds = timed(lambda: arc.load(text))
    same = all(
        torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        for a, b in zip(cache.layers, loaded.layers, strict=True)
    )
    if not same:
        raise SystemExit(f"{text}: the replayed cache is not the user's own")
    with open_container(folder / "replay.skv") as reader:
        token_bytes = sum(s.length for s in reader.sections if s.name.endswith("tokens"))
    n = len(ids)
    return {
        "text": text,
        "positions": n,
        "kv": report.kv,
        "relative_difference": report.relative_difference,
        "file_bits_per_position": round(report.file_bytes * 8 / n, 1),
        "tokens_only_file_bits_per_position": round(plain.file_bytes * 8 / n, 1),
        "beyond_tokens_only_bits_per_position": round(
            (report.file_bytes - plain.file_bytes) * 8 / n, 1
        ),
        "beyond_token_payload_bits_per_position": round(
            (report.file_bytes - token_bytes) * 8 / n, 1
        ),
        "bit_exact": same,
        "add_seconds": round(seconds, 1),
        "load_seconds": round(load_seconds, 1),
    }


def _add_replayed(path: Path, model, sid: str, ids, cache):
    import seqkv_cli as seqkv

    with seqkv.open_archive(path, model=model) as arc:
        return arc.add(sid, ids, cache=cache)


@torch.no_grad()  # nothing here trains: no autograd graphs
def main(argv: list[str] | None = None) -> dict:
    parser = harness.parser(__doc__)
    parser.add_argument("--tokens", type=int, default=400)
    parser.add_argument("--verify-all", action="store_true", help="decode every case")
    args = parser.parse_args(argv)

    from seqkv_cli.runtime.numerics import DEFAULT, build_canonical

    lm = harness.start(args)
    canon = build_canonical(lm.model, DEFAULT)

    def case(i: int, folder: Path) -> dict:
        text, dtype = CASES[i]
        verify = args.verify_all or i == 0
        return measure(lm, canon, text, dtype, args.tokens, folder, verify)

    rows = harness.per_case(range(len(CASES)), case)
    replay = harness.per_case(
        ["prose.txt"], lambda text, folder: replay_case(lm, text, args.tokens, folder)
    )
    return harness.finish(args, lm, markdown, rows=rows, replay=replay)


def markdown(result: dict) -> str:
    lines = [
        *harness.heading(
            "A foreign cache's residual (`bench/studies/foreign_residual.py`)", result
        ),
    ]
    head = [
        "text", "stored as", "positions", "log2 PP", "elements differing", "residual written",
        "as `SKR1`", "`SKR1` / written", "tokens bits/pos", "file bits/pos", "bit-exact",
    ]  # fmt: skip
    cells = [
        [r["text"], r["dtype"], f"{r['positions']:,}", f"{r['log2_ppl']:.3f}",
         f"{100 * r['differing_share']:.2f}%",
         f"{r['residual_bits_per_position']:,.1f} ({'/'.join(r['residual_streams'])})",
         f"{r['skr1_bits_per_position']:,.1f}",
         f"{r['skr1_bits_per_position'] / max(r['residual_bits_per_position'], 1e-9):.2f}x",
         f"{r['token_bits_per_position']:.3f}", f"{r['file_bits_per_position']:,.1f}",
         "verified" if r["verified_bit_exact"] else "not decoded"]
        for r in result["rows"]
    ]  # fmt: skip
    lines += table(head, cells, align="llrrrrrrrrl")
    head = [
        "text", "positions", "restored as", "rel. difference from the recompute",
        "file bits/pos", "tokens-only file bits/pos", "beyond tokens-only",
        "beyond the token payload", "bit-exact",
    ]  # fmt: skip
    cells = [
        [r["text"], f"{r['positions']:,}", r["kv"], f"{r['relative_difference']:.2e}",
         f"{r['file_bits_per_position']:,.1f}", f"{r['tokens_only_file_bits_per_position']:,.1f}",
         f"{r['beyond_tokens_only_bits_per_position']:,.1f}",
         f"{r['beyond_token_payload_bits_per_position']:,.1f}",
         "verified" if r["bit_exact"] else "no"]
        for r in result.get("replay", [])
    ]  # fmt: skip
    lines += [
        "",
        "A bf16-compute cache of the user's own run, archived by replay and loaded back here:",
        "",
        *table(head, cells, align="lrlrrrrrl"),
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
