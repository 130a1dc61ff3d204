"""Markdown tables of the two scaling sections (context length, sessions per archive)."""

from __future__ import annotations

from bench.report import _f, _table


def context(c: dict) -> list[str]:
    by = {(r["codec"], r["positions"]): r for r in c["rows"]}
    rows = []
    for n in c["lengths"]:
        s, f = by[("seq", n)], by[("seq-fast", n)]
        rows.append(
            [f"{n:,}", _f(s["log2_ppl"], ".3f"), _f(s["marginal_log2_ppl"], ".3f"),
             _f(s["bits_per_position"], ".3f"), _f(s["token_bits_per_position"], ".3f"),
             _f(s["encode_s"], ".2f"), _f(s["decode_s"], ".1f"),
             _f(f["bits_per_position"], ".2f"), _f(f["encode_s"], ".2f"),
             _f(f["decode_s"], ".2f")]
        )  # fmt: skip
    head = [
        "tokens", "log2 PP", "marginal log2 PP", "seq bits/pos", "seq token bits/pos",
        "seq enc s", "seq dec s", "seq-fast bits/pos", "seq-fast enc s", "seq-fast dec s",
    ]  # fmt: skip
    return [
        "### Scaling with context length",
        "",
        "One long document (prose.txt, sample_code.py, then the agent transcript), cut at each "
        "length. Marginal log2 PP: mean surprisal of the positions added since the previous "
        "length. seq decode times below the longest are read off the longest decode (the "
        "decoder reaches position L after L - 1 steps, whatever follows).",
        "",
        *_table(head, rows),
        "",
    ]


def sessions(s: dict) -> list[str]:
    rows = [
        [r["sessions"], f"{r['positions']:,}", f"{r['distinct_positions']:,}",
         f"{r['file_bytes']:,}", _f(r["bits_per_position"], ".3f"),
         _f(r["token_bits_per_position"], ".3f"), _f(r["encode_s"], ".1f"),
         _f(r.get("decode_s"), ".1f"), f"{r['separate_bytes']:,}", r["separate"],
         _f(r["separate_over_archive"], ".2f") + "x", _f(r.get("separate_encode_s"), ".1f")]
        for r in s["rows"]
    ]  # fmt: skip
    head = [
        "sessions", "positions", "distinct positions", "archive bytes", "bits/pos",
        "token bits/pos", "archive enc s", "archive dec s", "N separate files, bytes",
        "separate files", "separate / archive", "separate enc s",
    ]  # fmt: skip
    return [
        "### Scaling with sessions per archive (`seq`)",
        "",
        f"Each session: the chats' shared templated prefix ({s['prefix_tokens']} tokens) + its "
        f"own {s['tail_tokens']}-token tail (windows of other chat turns, prose and code). "
        "Captures are built from one prefix pass, bit-identical to a direct capture: "
        f"{'yes' if s['prefix_reuse_bit_exact'] else 'NO'}. Archive: `compress_captures` of N "
        "captures into one file (check off; decode verified bit-exact where timed). N separate "
        f"files: the first {s['singles_measured']} sessions compressed one by one; beyond them "
        "each file is estimated as its ideal token bytes + the singles' mean overhead "
        f"({s['single_overhead_bytes']:,.0f} bytes).",
        "",
        *_table(head, rows),
        "",
    ]
