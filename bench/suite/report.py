"""The Markdown report of one bench run (the JSON payload of bench/suite/run.py, rendered)."""

from __future__ import annotations

from bench.table import table


def _f(value, spec: str = ",.2f") -> str:
    return "—" if value is None else format(value, spec)


def header(p: dict) -> list[str]:
    env = p["environment"]
    model = env.get("model", {})
    inputs = ", ".join(f"{i['session']} ({i['positions']:,})" for i in p.get("inputs", []))
    total = sum(i["positions"] for i in p.get("inputs", []))
    return [
        f"## Bench run{' (quick)' if p['quick'] else ''} — {env['date']}",
        "",
        f"Command: `{p['command']}` — {p.get('total_seconds', 0) / 60:.1f} min in all.",
        f"Machine: {env['cpu']}, {env['cores']} cores, torch threads {env['torch_threads']}"
        f" (OMP_NUM_THREADS={env['omp_num_threads']}), GPU: {env['cuda'] or 'none'}.",
        f"Versions: seqkv {env['seqkv']} (commit {env['commit']}), Python {env['python']}, "
        f"torch {env['torch']}, numpy {env['numpy']}, transformers {env['transformers']}, "
        f"zstandard {env['zstandard']}. Model: {model.get('name')} "
        f"({model.get('fingerprint')}).",
        f"Inputs (canonical bf16 captures, positions): {inputs or '—'}; {total:,} in all.",
        "",
    ]


def rates(r: dict) -> list[str]:
    out = [
        "### Rate, fidelity and speed of every codec",
        "",
        f"Whole `.skv` files (headers included); log2 PP of the set {r['log2_ppl']:.3f} bits. "
        "Δ log2 PP: mean surprisal change of continuation tokens fed on the restored cache "
        "(lossy codecs only). MB/s counts K/V bytes consumed (encode) or produced (decode).",
        "",
    ]
    head = [
        "codec", "exact", "bits/position", "ratio vs fp16", "log2 PP", "max abs err",
        "rel. L2 err", "Δ log2 PP", "enc tok/s", "enc MB/s", "dec tok/s", "dec MB/s",
    ]  # fmt: skip
    rows = [
        [
            f"{x['codec']} {x['note']}".strip(), "yes" if x["bit_exact"] else "no",
            _f(x["bits_per_position"], ",.1f"), _f(x["ratio_vs_fp16"], ",.1f") + "x",
            _f(x["log2_ppl"], ".3f"), _f(x["max_abs_error"], ".4g"), _f(x["rel_l2_error"], ".4f"),
            _f(x.get("delta_log2_ppl"), "+.4f"), _f(x["encode_tokens_per_s"], ",.0f"),
            _f(x["encode_kv_MBps"], ",.1f"), _f(x["decode_tokens_per_s"], ",.1f"),
            _f(x["decode_kv_MBps"], ",.2f"),
        ]
        for x in r["rows"]
    ]  # fmt: skip
    out += table(head, rows)
    seq = {x["codec"]: x for x in r["rows"] if not x["note"]}
    if "seq" in seq and "seq-fast" in seq:
        out += [
            "",
            "Per session (library accounting: own bytes plus a share of shared trie parts):",
            "",
        ]
        rows = [
            [a["id"], f"{a['positions']:,}", _f(a["log2_ppl"], ".3f"),
             _f(a["bits_per_position"], ".3f"), _f(a["bits_per_position"] / a["log2_ppl"], ".4f"),
             _f(b["bits_per_position"], ".3f")]
            for a, b in zip(seq["seq"]["per_session"], seq["seq-fast"]["per_session"], strict=True)
        ]  # fmt: skip
        head = ["session", "positions", "log2 PP", "seq bits/pos", "÷ log2 PP", "seq-fast bits/pos"]
        out += table(head, rows)
    return [*out, ""]


def speed(s: dict) -> list[str]:
    n = s["tokens_per_measurement"]
    rows = [
        ["transformers DynamicCache step loop", f"{s['hf_step_loop_tokens_per_s']:.1f} tok/s", ""],
        ["seq decode, 1 session", f"{s['seq_decode_tokens_per_s_1_session']:.1f} tok/s",
         f"{s['seq_decode_vs_step_loop_1_session']:.2f}x the step loop"],
        ["seq decode, 8 sessions as rows", f"{s['seq_decode_tokens_per_s_8_sessions']:.1f} tok/s",
         f"{s['seq_decode_vs_step_loop_8_sessions']:.2f}x the step loop"],
        [f"transformers prefill of {s['prefill_tokens']:,} tokens", f"{s['hf_prefill_s']:.2f} s",
         ""],
        [f"seq-fast decode of {s['prefill_tokens']:,} tokens", f"{s['seq_fast_decode_s']:.2f} s",
         f"{s['seq_fast_decode_vs_prefill']:.2f}x one prefill"],
    ]  # fmt: skip
    from bench.studies.entropy import markdown

    return [
        "### Speed against plain transformers and zstd",
        "",
        f"Step loop and seq decode: {n} tokens per session.",
        "",
        *table(["measurement", "value", "ratio"], rows),
        "",
        f"Entropy coder alone, one thread, {s['entropy_size_mib']:g} MiB per byte plane of real "
        "bf16 K/V (constriction not used by seqkv, not measured):",
        "",
        markdown(s["entropy"]),
        "",
    ]


def memory(m: dict) -> list[str]:
    base = {r["op"]: r["peak_rss_MiB"] for r in m["rows"] if r["codec"] == "-"}

    def above(r: dict) -> str:
        if r["codec"] == "-":
            return ""
        key = "imports + model loaded" if r["codec"].startswith("seq") else "import only"
        return f"{r['peak_rss_MiB'] - base[key]:+,.0f}"

    rows = [
        [r["codec"], r["op"], f"{r['peak_rss_MiB']:,.0f}", above(r), f"{r['seconds']:.2f}"]
        for r in m["rows"]
    ]
    return [
        "### Peak memory (one child process per operation)",
        "",
        f"One capture of {m['positions']:,} positions ({m['capture']}); compress with check off. "
        "'Above baseline': over imports alone (per-vector codecs) or imports + model (seq, "
        "seq-fast). Seconds: the operation alone, model loading excluded.",
        "",
        *table(["codec", "operation", "peak RSS MiB", "above baseline MiB", "seconds"], rows),
        "",
    ]


def profile(p: dict) -> list[str]:
    runs = p["runs"]
    labels = list(dict.fromkeys(k for r in runs.values() for k in r["seconds"]))
    head = ["where the time goes", *(f"{k.replace('_', ' ')} s" for k in runs), "share"]
    rows = [
        [label, *(_f(r["seconds"].get(label), ".2f") for r in runs.values()),
         " / ".join(f"{r['seconds'].get(label, 0) / r['total_s']:.1%}" for r in runs.values())]
        for label in labels
    ]  # fmt: skip
    rows.append(["total", *(f"{r['total_s']:.2f}" for r in runs.values()), ""])
    shares = ", ".join(f"{k.replace('_', ' ')}: {r['model_share']:.1%}" for k, r in runs.items())
    return [
        f"### Profile: `seq` compress of one {p['positions']:,}-token session (cProfile)",
        "",
        f"Model compute share — {shares} (target > 90%). Unprofiled, check off: "
        f"{p['unprofiled_check_off_s']:.2f} s.",
        "",
        *table(head, rows),
        "",
    ]


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
        *table(head, rows),
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
        *table(head, rows),
        "",
    ]


def render(payload: dict) -> str:
    parts = {
        "rates": rates,
        "speed": speed,
        "memory": memory,
        "context": context,
        "sessions": sessions,
        "profile": profile,
    }
    lines = header(payload)
    for name, result in payload["results"].items():
        lines += parts[name](result)
    return "\n".join(lines)
