"""Where `seq` compress spends its time: model compute vs coding overhead (cProfile).

Profiles `compress_captures([one capture], codec="seq")` with check off (encode only) and on
(the CLI default: every session is decoded again before the file counts as written), and
splits the wall time by the functions that do each job. The split uses cumulative times, and
for functions called from several places only the calls from the named caller, so no second
is counted twice; "other" is what no category claims (container I/O, CRCs, Python glue).
"""

from __future__ import annotations

import cProfile
import pstats
from pathlib import Path

from bench.harness import timed
from bench.suite.common import Run

# (category, file suffix, function name); a category may list several functions
CATEGORIES = (
    ("model forward (canonical)", "runtime/portable/model.py", "_run"),
    ("surprisal (fp64 log-softmax per row)", "runtime/surprisal.py", "surprisal_bits"),
    ("surprisal (fp64 log-softmax per row)", "runtime/surprisal.py", "portable_surprisal_bits"),
    ("frequency tables from logits", "sequential/probability.py", "frequencies_from_logits"),
    ("encoder: interval lookup", "sequential/token_coder.py", "_intervals"),  # flat layout
    ("encoder: interval lookup", "sequential/node_stream.py", "intervals"),  # trie layout
    ("range coder", "sequential/rangecoder.py", "encode"),
    ("range coder", "sequential/rangecoder.py", "finish"),
    ("range coder", "sequential/token_coder.py", "decode_one_token"),  # CDF + search + advance
    ("range coder", "sequential/rangecoder.py", "decode_symbol"),
    ("K/V to bf16 + residual compare", "sequential/adapter.py", "kv"),
    ("K/V to bf16 + residual compare", "trie/runs.py", "session_kv"),
    ("K/V to bf16 + residual compare", "sequential/session_codec.py", "kv_bits"),
    ("K/V to bf16 + residual compare", "sequential/session_codec.py", "add_residual"),
    ("round-trip comparison", "archive/create.py", "same_capture"),
    ("capture file load", "kvcapture/capture_file.py", "load_capture"),
)
MODEL = CATEGORIES[0][0]


def _find(stats: dict, suffix: str, name: str) -> list:
    return [k for k in stats if k[0].endswith(suffix) and k[2] == name]


def split(profile: cProfile.Profile) -> dict:
    """Seconds per category, the total, and the model's share."""
    stats = pstats.Stats(profile).stats
    [top] = _find(stats, "archive/create.py", "compress_captures")
    total = stats[top][3]
    out: dict[str, float] = {}
    for label, suffix, name in CATEGORIES:
        for key in _find(stats, suffix, name):
            out[label] = out.get(label, 0.0) + stats[key][3]
    # the flat encoder's _intervals holds its model feeds and tables: count those once
    for key in _find(stats, "sequential/token_coder.py", "_intervals"):
        inner = 0.0
        for callee, (_, _, _, _, callers) in stats.items():
            if key in callers and callee[2] in ("feed_checked", "frequencies_from_logits"):
                # feed_checked -> CanonicalLogits.feed -> _run + surprisal_bits: own rows
                inner += callers[key][3]
        out["encoder: interval lookup"] -= inner
    out = {k: v for k, v in out.items() if v > 0}
    out["other (container, CRC, glue)"] = total - sum(out.values())
    return {
        "total_s": total,
        "seconds": out,
        "model_share": out.get(MODEL, 0.0) / total,
    }


def run_profile(run: Run, capture_path: Path, positions: int, with_check: bool = True) -> dict:
    from seqkv_cli.archive import compress_captures

    folder = run.scratch("profile")
    run.log(f"profile: seq compress of {positions:,} positions, unprofiled (check off)")
    _, plain = timed(
        lambda: compress_captures(
            [capture_path], folder / "plain.skv", codec="seq", model=run.lm, check=False
        )
    )
    result = {"positions": positions, "unprofiled_check_off_s": plain, "runs": {}}
    for check in (False, True) if with_check else (False,):
        run.log(f"profile: seq compress under cProfile, check {'on' if check else 'off'}")
        profile = cProfile.Profile()
        profile.enable()
        compress_captures(
            [capture_path], folder / f"p{int(check)}.skv", codec="seq", model=run.lm, check=check
        )
        profile.disable()
        result["runs"]["check_on" if check else "check_off"] = split(profile)
    return result
