"""Scaling with sessions per archive: N shared-prefix sessions in one `.skv` vs N files.

For each N the first N sessions go through `compress_captures(..., codec="seq")` into one
archive: size and encode time, decode time (bit-exact check) for N in `decode`. Whatever
`compress_captures` does about shared prefixes (the token trie) is measured as is.

"N separate files" is the first N sessions compressed one by one. Only the first `singles`
are compressed for real (each is a full encode of all its positions); beyond them a
session's file is estimated as its ideal token cost (bench/suite/sessions.py) plus the mean
overhead (file bytes - ideal token bytes) of the real singles. Such rows say "estimated".
"""

from __future__ import annotations

import math

from bench.suite.common import Run, compress, restore
from bench.suite.sessions import FULL, QUICK, SessionFactory, check_exact, prefix_and_pool, tails

POINTS_FULL, DECODE_FULL, SINGLES_FULL = (1, 2, 5, 10, 20, 50, 100), (10,), 10
POINTS_QUICK, DECODE_QUICK, SINGLES_QUICK = (1, 2, 5), (2,), 2


def _restore_exact(run: Run, skv, caps: list) -> float:
    from seqkv_cli.archive import same_capture

    restored, seconds = restore(run, skv, [c.session_id for c in caps])
    if not all(same_capture(a, b) for a, b in zip(caps, restored, strict=True)):
        raise SystemExit(f"{skv.name}: sessions did not restore bit-exactly")
    return seconds


def run_archives(run: Run, points=None, decode=None, singles=None) -> dict:
    from bench.suite.inputs import save

    points = sorted(points or (POINTS_QUICK if run.quick else POINTS_FULL))
    decode = tuple(decode or (DECODE_QUICK if run.quick else DECODE_FULL))
    singles = min(singles or (SINGLES_QUICK if run.quick else SINGLES_FULL), points[-1])
    prefix_len, tail_len = QUICK if run.quick else FULL
    prefix, pool = prefix_and_pool(run.lm, prefix_len)
    count = points[-1]
    run.log(f"sessions: shared prefix of {prefix_len} tokens + {count} tails of {tail_len}")
    factory = SessionFactory(run, prefix, tail_len)
    folder, ideal, paths, caps = run.scratch("sessions"), [], [], []
    for i, tail in enumerate(tails(pool, count, tail_len)):
        cap, bits = factory.make(f"session-{i:03d}", tail)
        ideal.append(math.ceil(bits / 8))
        paths.append(save(cap, folder))
        if i < max(decode):
            caps.append(cap)
        if (i + 1) % 10 == 0:
            run.log(f"sessions: {i + 1} of {count} captured")
    exact = check_exact(run, caps[0])
    run.log(f"sessions: prefix-reuse capture bit-identical to a direct capture: {exact}")
    run.log(f"sessions: {singles} sessions compressed one by one")
    alone = [
        compress(run, [p], folder / f"single-{i}.skv", "seq") for i, p in enumerate(paths[:singles])
    ]
    sizes = [res.file_bytes for res, _ in alone]
    overhead = sum(b - t for b, t in zip(sizes, ideal, strict=False)) / len(sizes)
    sizes += [t + overhead for t in ideal[singles:]]
    rows = []
    for n in points:
        run.log(f"sessions: archive of {n}")
        res, t_enc = compress(run, paths[:n], folder / f"archive-{n}.skv", "seq")
        row = {
            "sessions": n,
            "positions": res.positions,
            "distinct_positions": prefix_len + n * tail_len,
            "file_bytes": res.file_bytes,
            "bits_per_position": res.file_bytes * 8 / res.positions,
            "token_bits_per_position": res.part_bytes.get("tokens", 0) * 8 / res.positions,
            "encode_s": t_enc,
            "separate_bytes": round(sum(sizes[:n])),
            "separate": "measured" if n <= singles else f"estimated beyond {singles}",
            "separate_encode_s": sum(t for _, t in alone[:n]) if n <= singles else None,
        }
        row["separate_over_archive"] = row["separate_bytes"] / res.file_bytes
        if n in decode:
            run.log(f"sessions: decode of the archive of {n}")
            row["decode_s"] = _restore_exact(run, folder / f"archive-{n}.skv", caps[:n])
        rows.append(row)
        (folder / f"archive-{n}.skv").unlink()
    return {
        "prefix_tokens": prefix_len,
        "tail_tokens": tail_len,
        "prefix_reuse_bit_exact": exact,
        "singles_measured": singles,
        "single_overhead_bytes": overhead,
        "rows": rows,
    }
