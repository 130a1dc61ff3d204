"""Markdown for bench/gpu_check.py's results."""

from __future__ import annotations


def _yes(flag: bool) -> str:
    return "yes" if flag else "**NO**"


def markdown(r: dict) -> str:
    failed = {k: v["error"] for k, v in r.items() if isinstance(v, dict) and "error" in v}
    r = {k: v for k, v in r.items() if k not in failed}
    lines = [
        f"## GPU check ({r['mode']}) — {r['device_name']}, torch {r['torch']}",
        "",
        "Entropy coder: numpy on CPU vs torch on the device, same symbols and lanes "
        "(K/V-shaped bf16 byte planes).",
        "",
        "| plane | symbols | lanes | bits/symbol | bytes identical | device decodes CPU stream "
        "| CPU decodes device stream | device round trip | CPU numpy enc GB/s | device enc GB/s "
        "| device dec GB/s |",
        "|" + " --- |" * 11,
    ]
    for e in r.get("entropy", []):
        lines.append(
            f"| {e['plane']} | {e['symbols']:,} | {e['lanes']:,} | {e['bits_per_symbol']:.3f} "
            f"| {_yes(e['bytes_identical'])} | {_yes(e['device_decodes_cpu_stream'])} "
            f"| {_yes(e['cpu_decodes_device_stream'])} | {_yes(e['device_round_trip'])} "
            f"| {e['cpu_numpy_encode_GBps']:.3f} | {e['device_encode_GBps']:.3f} "
            f"| {e['device_decode_GBps']:.3f} |"
        )
    lines += [
        "",
        "Token-coder frequency tables: `frequencies_from_logits` (numpy, CPU) vs "
        "`frequencies_from_logits_torch` on the device.",
        "",
        "| logits | rows | precision bits | identical |",
        "| --- | --- | --- | --- |",
    ]
    for t in r.get("tables", []):
        lines.append(
            f"| {t['logits']} | {t['rows']} | {t['precision_bits']} | {_yes(t['identical'])} |"
        )
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
            "| measurement | value |",
            "| --- | --- |",
            f"| decode, library path (device forward, CPU tables + range decoder) "
            f"| {k['decode_tokens_per_s']:,.1f} tok/s |",
            f"| forward_rows, one step of all sessions | {k['forward_rows_step_s'] * 1e3:.2f} ms |",
            f"| frequency tables of one step on the device | {k['device_tables_step_s'] * 1e3:.2f}"
            " ms |",
            f"| ceiling with tables on the device (forward + tables only) "
            f"| {k['ceiling_tokens_per_s']:,.1f} tok/s |",
        ]
    if r.get("portable"):
        from bench.gpu_portable import markdown as portable_markdown

        lines += portable_markdown(r["portable"])
    from bench.gpu_files import markdown as files_markdown

    for step in ("files", "files_many"):
        if r.get(step):
            lines += files_markdown(r[step])
    seconds = ", ".join(f"{k[:-8]} {v:.0f} s" for k, v in r.items() if k.endswith("_seconds"))
    lines += [f"\nStep `{k}` failed: {v}" for k, v in failed.items()]
    return "\n".join([*lines, "", f"Time per step: {seconds}.", ""])
