"""Issue 5 done-when: 100 sessions sharing a 2,000-token prefix + ~200 tokens each.

Captures are made the cheap exact way: the prefix is run once through the canonical forward
and each session continues a fork of that state (bit-identical to capturing it whole; checked
on one session against `seqkv_cli.kvcapture.api.capture_one`-style capture). Then:

* the 100 sessions go into one trie archive with `compress_captures(codec="seq")`;
* `--singles K` of them are compressed one by one (each a full 2,200-token encode); the
  one-by-one total is their mean times 100 (stated as such in the output);
* per-session overhead = (archive - prefix-node payload - Σ branch payloads - the bytes an
  empty archive costs) / 100.

    python -m bench.studies.trie --threads 2 --json bench/results/trie.json
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from bench import harness
from bench.harness import ROOT, SAMPLE, timed


def corpus_tokens(tokenizer) -> tuple[np.ndarray, np.ndarray]:
    prefix_text = (SAMPLE / "prose.txt").read_text() + (SAMPLE / "sample_code.py").read_text()
    pool_text = (SAMPLE / "agent_transcript.jsonl").read_text()
    enc = lambda t: np.array(tokenizer(t, add_special_tokens=False)["input_ids"], np.int64)  # noqa: E731
    return enc(prefix_text), enc(pool_text)


def make_captures(lm, n: int, prefix_len: int, tail: int, out: Path) -> list[Path]:
    from seqkv_cli.kvcapture.capture_file import Capture, save_capture
    from seqkv_cli.kvcapture.engine import canonical_model
    from seqkv_cli.runtime.legacy import NUMERIC_PATH
    from seqkv_cli.sequential.adapter import CanonicalLogits
    from seqkv_cli.trie import fork_track

    canon = canonical_model(lm)
    prefix, pool = corpus_tokens(lm.tokenizer)
    prefix = prefix[:prefix_len]
    assert len(pool) >= tail + 25 * (n - 1), len(pool)
    adapter = CanonicalLogits(canon)
    base = adapter.start(prefix_len + tail)
    logits = None
    for s in range(0, prefix_len, 256):
        ids = torch.from_numpy(prefix[s : s + 256])
        logits = canon.forward(base.state, ids)
        base.record(ids, logits)
    meta = {
        "dtype": "bf16",
        "numeric_path": NUMERIC_PATH,
        "num_layers": canon.num_layers,
        "num_kv_heads": canon.num_kv_heads,
        "head_dim": canon.head_dim,
        "model_fingerprint": lm.fingerprint,
        "tokenizer_fingerprint": lm.tokenizer_fingerprint,
        "model_name": lm.name,
        "source": "bench/studies/trie.py",
    }
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        suffix = pool[25 * i : 25 * i + tail]
        track = fork_track(adapter, base, prefix_len, prefix_len + tail, logits[-1].clone())
        ids = torch.from_numpy(suffix)
        track.record(ids, canon.forward(track.state, ids))
        keys, values = track.kv(canon.num_layers, torch.bfloat16)
        tokens = torch.from_numpy(np.concatenate([prefix, suffix]))
        sid = f"session-{i:03d}"
        cap = Capture(
            tokens,
            keys,
            values,
            track.surprisal,
            {**meta, "session_id": sid, "positions": len(tokens)},
        )
        paths.append(out / f"{sid}.safetensors")
        save_capture(cap, paths[-1])
        adapter.tracks[:] = [base]
    return paths


def check_exact(lm, path: Path) -> bool:
    """The forked capture equals a whole-sequence canonical capture, bit for bit."""
    from seqkv_cli.archive import same_capture
    from seqkv_cli.kvcapture.capture_file import load_capture
    from seqkv_cli.kvcapture.engine import run_capture

    cap = load_capture(path)
    whole = run_capture(lm, cap.tokens.tolist(), dtype="bf16")
    whole.meta = cap.meta
    return same_capture(cap, whole)


def main(argv: list[str] | None = None) -> dict:
    ap = harness.parser(__doc__, threads=2)
    ap.add_argument("--sessions", type=int, default=100)
    ap.add_argument("--prefix", type=int, default=2000)
    ap.add_argument("--tail", type=int, default=200)
    ap.add_argument("--singles", type=int, default=5)
    ap.add_argument("--work", type=Path, default=Path("/tmp/seqkv-bench-trie"))
    ap.set_defaults(json=ROOT / "bench/results/trie.json")
    args = ap.parse_args(argv)
    from seqkv_cli.archive import Archive, compress_captures

    lm = harness.start(args)
    shutil.rmtree(args.work, ignore_errors=True)
    paths, made = timed(
        lambda: make_captures(lm, args.sessions, args.prefix, args.tail, args.work / "caps")
    )
    exact = check_exact(lm, paths[-1])
    archive, encode_s = timed(
        lambda: compress_captures(paths, args.work / "all.skv", codec="seq", model=lm, check=False)
    )
    with Archive(args.work / "all.skv") as arc:
        nodes = arc.trie.nodes
        payloads = [n.payload for n in nodes]
        empty_overhead = arc.reader.size - sum(s.length for s in arc.reader.sections)
    t = time.perf_counter()
    with Archive(args.work / "all.skv", model=lm) as arc:
        [(_, one)] = list(arc.restore_many([arc.sessions[-1]]))
    extract_s = time.perf_counter() - t
    singles = []
    for p in paths[: args.singles]:
        r = compress_captures([p], args.work / f"{p.stem}.skv", codec="seq", model=lm, check=False)
        singles.append(r.file_bytes)
    one_by_one = float(np.mean(singles)) * args.sessions
    # An archive's fixed cost: superblock, header JSON, index record, the first table bytes.
    tables = archive.part_bytes.get("trie tables", 0)
    overhead = (archive.file_bytes - sum(payloads) - empty_overhead) / args.sessions
    result = {
        "sessions": args.sessions,
        "prefix_tokens": args.prefix,
        "tail_tokens": args.tail,
        "captures_exact_vs_whole_capture": exact,
        "capture_seconds": round(made, 1),
        "archive_bytes": archive.file_bytes,
        "archive_encode_seconds": round(encode_s, 1),
        "extract_one_seconds": round(extract_s, 1),
        "extract_exact": not isinstance(one, Exception),
        "nodes": len(nodes),
        "root_payload_bytes": payloads[0],
        "branch_payload_bytes_mean": float(np.mean(payloads[1:])),
        "trie_table_bytes": tables,
        "container_bytes_outside_sections": empty_overhead,
        "per_session_overhead_bytes": round(overhead, 2),
        "single_file_bytes_measured": singles,
        "one_by_one_bytes_estimate": round(one_by_one),
        "ratio_one_by_one_over_archive": round(one_by_one / archive.file_bytes, 2),
    }
    return harness.finish(args, lm, lambda r: json.dumps(r, indent=1), **result)


if __name__ == "__main__":
    main()
