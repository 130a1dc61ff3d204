"""Markdown for bench/gpu/check.py's results."""

from __future__ import annotations

from bench.table import table

# the steps of bench/gpu/check.py, in the order it runs them (here: the report lists what
# did not run, and gpu_check imports this module)
STEPS = (
    "entropy_identity",
    "entropy_speed",
    "entropy_crossover",
    "files",
    "portable",
    "tables",
    "canonical",
    "files_many",
    "token_coder",
)


def _yes(flag: bool) -> str:
    return "yes" if flag else "**NO**"


def markdown(r: dict) -> str:
    failed = {k: v["error"] for k, v in r.items() if isinstance(v, dict) and "error" in v}
    r = {k: v for k, v in r.items() if k not in failed}
    lines = [f"## GPU check ({r['mode']}) — {r['device_name']}, torch {r['torch']}", ""]
    lines += _entropy(r)
    lines += [
        "",
        "Token-coder frequency tables: `frequencies_from_logits` (numpy, CPU) vs "
        "`frequencies_from_logits_torch` on the device.",
        "",
        *table(
            ["logits", "rows", "precision bits", "identical"],
            [
                [t["logits"], t["rows"], t["precision_bits"], _yes(t["identical"])]
                for t in r.get("tables", [])
            ],
        ),
    ]
    c = r.get("canonical")
    if c:
        lines += [
            "",
            f"Canonical forward on the device: row-block-padded products row-invariant: "
            f"{_yes(c['row_invariant_products'])}; logits of {c['tokens']} tokens bit-identical "
            f"to CPU: {_yes(c['logits_bit_identical_to_cpu'])} ({c['logits_elements_equal']:.1%}"
            f" of elements equal, max abs diff {c['logits_max_abs_diff']:.3g}).",
        ]
    k = r.get("token_coder")
    if k:
        lines += [
            "",
            f"Token coder, {k['sessions']} sessions x {k['tokens_per_session']} tokens in "
            f"lockstep on {k['device']} (model shape {r['model_shape']}, random weights): "
            f"{k['sessions_decoded_exactly']} of {k['sessions']} decoded exactly.",
            "",
            *table(
                ["measurement", "value"],
                [
                    [
                        "decode, library path (device forward, CPU tables + range decoder)",
                        f"{k['decode_tokens_per_s']:,.1f} tok/s",
                    ],
                    [
                        "forward_rows, one step of all sessions",
                        f"{k['forward_rows_step_s'] * 1e3:.2f} ms",
                    ],
                    [
                        "frequency tables of one step on the device",
                        f"{k['device_tables_step_s'] * 1e3:.2f} ms",
                    ],
                    [
                        "ceiling with tables on the device (forward + tables only)",
                        f"{k['ceiling_tokens_per_s']:,.1f} tok/s",
                    ],
                ],
            ),
        ]
    if r.get("portable"):
        from bench.gpu.portable import markdown as portable_markdown

        lines += portable_markdown(r["portable"])
    from bench.gpu.files import markdown as files_markdown

    for step in ("files", "files_many"):
        if r.get(step):
            lines += files_markdown(r[step])
    seconds = ", ".join(f"{k[:-8]} {v:.0f} s" for k, v in r.items() if k.endswith("_seconds"))
    lines += [f"\nStep `{k}` failed: {v}" for k, v in failed.items()]
    skipped = {
        k: v["skipped"]
        for k, v in r.items()
        if isinstance(v, dict) and "skipped" in v and not k.startswith("files")  # says it itself
    }
    lines += [f"\nStep `{k}` skipped: {v}" for k, v in skipped.items()]
    lines += ["", f"Time per step: {seconds}.", "", *next_steps(r, failed)]
    return "\n".join([*lines, ""])


DECODE_TARGET, ENCODE_TARGET = 100.0, 50.0  # GB/s on 256 MB of byte planes (issue 39)


def _entropy(r: dict) -> list[str]:
    lines = []
    ident = r.get("entropy_identity")
    if ident and "streams" in ident:
        lines += [
            f"Entropy kernels ({ident['kernel']}) against the numpy coder: "
            f"{ident['identical']} of {ident['streams']} streams identical both ways "
            f"({ident['symbols']:,} symbols, largest {ident['largest']:,}; "
            f"{ident.get('decoded_on_cpu', 0)} with too many lanes for the GPU decoded by numpy).",
            "",
        ]
        lines += [f"- FAILED {f['case']}: {', '.join(f['failed'])}" for f in ident["failures"]]
    rows = (r.get("entropy_speed") or {}).get("rows", [])
    if rows:
        lines += [
            "Entropy kernels on bf16 K/V byte planes (GB/s of symbols; device-resident kernels,"
            " then host to host; numpy on this machine's CPU):",
            "",
        ]
        head = [
            "plane", "symbols", "lanes", "steps", "bits/symbol", "identical", "GPU enc",
            "GPU dec", "dec µs/step", "e2e enc", "e2e dec", "numpy enc", "numpy dec",
            "first call s",
        ]  # fmt: skip
        cells = []
        for e in rows:
            same = e["bytes_identical"] and e["gpu_decodes_exactly"]
            fell = " (numpy: too many lanes)" if e.get("decode_fell_back_to_cpu") else ""
            cells.append(
                [e["plane"], f"{e['symbols']:,}", f"{e['lanes']:,}", f"{e['steps']:,}",
                 f"{e['bits_per_symbol']:.3f}", _yes(same and e["cpu_decodes_gpu_stream"]),
                 f"{e['gpu_encode_GBps']:.1f}", f"{e['gpu_decode_GBps']:.1f}{fell}",
                 f"{e['gpu_decode_us_per_step']:.2f}", f"{e['gpu_end_to_end_encode_GBps']:.2f}",
                 f"{e['gpu_end_to_end_decode_GBps']:.2f}", f"{e['cpu_numpy_encode_GBps']:.3f}",
                 f"{e['cpu_numpy_decode_GBps']:.3f}", f"{e['first_call_s']:.1f}"]
            )  # fmt: skip
        lines += [*table(head, cells), ""]
    cross = r.get("entropy_crossover") or {}
    if cross.get("rows"):
        lines += [
            "Host to host, per-vector lane count (ms): where the GPU starts to pay.",
            "",
            *table(
                ["symbols", "lanes", "numpy enc", "GPU enc", "numpy dec", "GPU dec"],
                [
                    [
                        f"{c['symbols']:,}",
                        f"{c['lanes']:,}",
                        f"{c['cpu_encode_ms']:.2f}",
                        f"{c['gpu_encode_ms']:.2f}",
                        f"{c['cpu_decode_ms']:.2f}",
                        f"{c['gpu_decode_ms']:.2f}",
                    ]
                    for c in cross["rows"]
                ],
            ),
        ]
        lines += ["", f"GPU faster both ways from {cross['gpu_pays_from_symbols']} symbols.", ""]
    return lines


def next_steps(r: dict, failed: dict) -> list[str]:
    """What to run or change next, from what this report holds."""
    out = ["### Next", ""]
    missing = [s for s in STEPS if s not in r and s not in failed]
    redo = [*failed, *missing]
    if redo:
        out.append(
            f"- Run again what failed or did not run ({', '.join(redo)}): "
            f'`bash bench/gpu/check.sh "$OUT" --only={",".join(redo)}`.'
        )
    ident = r.get("entropy_identity") or {}
    if ident.get("failures"):
        out.append(
            "- The kernels differ from numpy: reproduce on the CPU with "
            "`pytest tests/codecs/test_entropy_kernel.py` (the kernel source, the simulator); a "
            "failure only on the GPU with several decode blocks points at the cross-block "
            "offsets in cuda_kernels.decode (the simulator runs one block)."
        )
    rows = (r.get("entropy_speed") or {}).get("rows", [])
    if rows:
        dec = max(
            (e["gpu_decode_GBps"] for e in rows if not e.get("decode_fell_back_to_cpu")),
            default=0.0,
        )
        enc = max(e["gpu_encode_GBps"] for e in rows)
        verdict = "met" if dec >= DECODE_TARGET and enc >= ENCODE_TARGET else "NOT met"
        out.append(
            f"- Targets (decode >= {DECODE_TARGET:.0f}, encode >= {ENCODE_TARGET:.0f} GB/s): "
            f"{verdict} (best decode {dec:.1f}, encode {enc:.1f} GB/s on {r['device_name']})."
        )
        if dec < DECODE_TARGET:
            out.append(
                "- Decode is bound by one grid barrier per step (column dec µs/step x steps): "
                "fewer steps (more lanes) or a stream version with per-block word runs "
                "(docs/format/ENTROPY_STREAM.md, 'On a GPU') is the way past it."
            )
    cross = r.get("entropy_crossover") or {}
    if cross.get("gpu_pays_from_symbols"):
        out.append(
            f"- Set `GPU_MIN_SYMBOLS = {cross['gpu_pays_from_symbols']}` in "
            "codecs/seqkv_codecs/entropy/placement.py (now a CPU-side estimate)."
        )
    out.append(
        "- Put the numbers, with the device's name, in docs/BENCHMARKS_LOG.md and "
        "docs/format/ENTROPY_STREAM.md ('On a GPU'), and the JSON in bench/results/."
    )
    return out
