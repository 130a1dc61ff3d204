"""Scale-out figures (issue 15): 1,000 chat sessions into prefix shards, on 1 and 2 Ray workers.

The sessions are generated from sample_data/chats.jsonl: four system prompts (chat-01's and
the three near-duplicates'), each with the turns of one of the 13 chats cut after 2 to 8 of
them, and a last user message of its own ("Ticket #i ..."), so every session is distinct and
most share a long prefix. The same sessions are compressed (with the embedded model unless
--model says otherwise; verification off, as the tests check restores bit for bit):

* into one archive (`seqkv compress sessions.jsonl -o one.skv`),
* into shards without Ray (the serial pipeline),
* into shards on a local Ray cluster with 1 and with 2 model actors.

Reported: sessions/s and tokens/s of each run, total shard bytes against the single archive,
and an estimate for N GPU actors from the measured per-actor rate.

    python -m bench.studies.scale --json bench/results/scale.json --append docs/BENCHMARKS_LOG.md
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

from bench import harness
from bench.harness import SAMPLE
from bench.table import table

TOPICS = ["a late parcel", "a torn tent seam", "a gift card balance", "store hours", "sizing"]


def sessions(count: int) -> list[dict]:
    chats = [json.loads(line) for line in (SAMPLE / "chats.jsonl").read_text().splitlines()]
    by_id = {c["id"]: c for c in chats}
    prompts = [by_id[i]["messages"][0] for i in ("chat-01", "near-01", "near-02", "near-03")]
    bodies = [c["messages"][1:] for c in chats if c["id"].startswith("chat-")]
    rows = []
    for i in range(count):
        body = bodies[(i // 4) % len(bodies)]
        cut = 2 * (1 + (i // 52) % 4)  # 2, 4, 6 or 8 turns, ending on an assistant turn
        last = {"role": "user", "content": f"Ticket #{i}: one more question about {TOPICS[i % 5]}."}
        rows.append({"id": f"s{i:05d}", "messages": [prompts[i % 4], *body[:cut], last]})
    return rows


def main(argv: list[str] | None = None) -> dict:
    ap = harness.parser(__doc__)
    ap.add_argument("--sessions", type=int, default=1000)
    ap.add_argument("--shard-sessions", type=int, default=250)
    ap.add_argument(
        "--tiny",
        action="store_true",
        help="a randomly initialised 2-layer model (tests/conftest.py, 4,096 positions): "
        "measures the pipeline itself, not the model's forward",
    )
    ap.add_argument("--workers", default="1,2", help="Ray actor counts to run")
    args = ap.parse_args(argv)

    from seqkv_cli.scale.common import DatasetOptions
    from seqkv_cli.scale.local import compress_dataset, compress_dataset_to_file

    folder = Path(tempfile.mkdtemp(prefix="seqkv-scale-"))
    if args.tiny:
        from tests.conftest import build_tiny_model

        args.model = str(build_tiny_model(folder / "tiny-llama", context=4096))
    lm = harness.start(args)
    data = folder / "sessions.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in sessions(args.sessions)))
    options = DatasetOptions(shard_sessions=args.shard_sessions, verify=False)
    runs = []

    def record(name, seconds, sessions_done, tokens, file_bytes, shards):
        runs.append(
            {
                "run": name,
                "seconds": round(seconds, 1),
                "sessions": sessions_done,
                "tokens": tokens,
                "sessions_per_s": round(sessions_done / seconds, 2),
                "tokens_per_s": round(tokens / seconds),
                "bytes": file_bytes,
                "shards": shards,
            }
        )
        print(json.dumps(runs[-1]), flush=True)

    t = time.perf_counter()
    one = compress_dataset_to_file([data], folder / "one.skv", lm, options)
    record(
        "one archive (no shards)",
        time.perf_counter() - t,
        one.sessions,
        one.positions,
        one.file_bytes,
        1,
    )
    t = time.perf_counter()
    res = compress_dataset([data], folder / "serial", lm, options=options)
    record(
        "shards, serial",
        time.perf_counter() - t,
        res.sessions,
        res.tokens,
        res.file_bytes,
        res.shards,
    )
    for workers in [int(w) for w in args.workers.split(",") if w]:
        out = folder / f"ray-{workers}"
        t = time.perf_counter()
        res = compress_dataset(
            [data],
            out,
            args.model,
            options=options,
            ray_address="local",
            workers=workers,
            cpus_per_worker=1,
        )
        record(
            f"shards, Ray, {workers} actor(s)",
            time.perf_counter() - t,
            res.sessions,
            res.tokens,
            res.file_bytes,
            res.shards,
        )
        import ray

        ray.shutdown()
    single = runs[0]["bytes"]
    for r in runs:
        r["bytes_vs_one_archive"] = round(r["bytes"] / single, 3)
    ray_runs = [r for r in runs if "Ray" in r["run"]]
    per_actor = max((r["sessions_per_s"] for r in ray_runs), default=0) / max(
        (int(r["run"].split(", ")[2].split()[0]) for r in ray_runs), default=1
    )
    shutil.rmtree(folder, ignore_errors=True)
    return harness.finish(
        args,
        lm,
        markdown,
        sessions=args.sessions,
        shard_sessions=args.shard_sessions,
        tiny_model=args.tiny,
        runs=runs,
        per_actor_sessions_per_s=round(per_actor, 2),
    )


def markdown(result: dict) -> str:
    env = result["environment"]
    lines = [
        *harness.heading(
            f"Scale-out: {result['sessions']:,} chat sessions into prefix shards", result
        ),
        f"Model {'tiny random 2-layer llama' if result['tiny_model'] else env['model']['name']}; "
        f"shards of up to {result['shard_sessions']} sessions, verification off.",
        "",
    ]
    head = ["run", "shards", "seconds", "sessions/s", "tokens/s", "bytes", "vs one archive"]
    cells = [
        [r["run"], r["shards"], f"{r['seconds']:,.1f}", f"{r['sessions_per_s']:.2f}",
         f"{r['tokens_per_s']:,}", f"{r['bytes']:,}", f"{r['bytes_vs_one_archive']:.3f}x"]
        for r in result["runs"]
    ]  # fmt: skip
    lines += table(head, cells, align="lrrrrrr")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
