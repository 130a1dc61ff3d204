"""`compress_dataset`: a session dataset -> a directory of shard archives + a manifest.

Steps (the same with and without Ray): ids are checked over the whole input before any model
work (a missing or repeated id is refused, naming its row); sessions are tokenized and keyed
by their first tokens; the per-key counts give the shard plan (plan.py); every shard is built
(shard.py) and published atomically; the manifest is written last. A rerun over the same
input skips the shards that are complete, and removes shard files no longer in the plan.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import numpy as np

from seqkv_cli.errors import SeqkvError
from seqkv_cli.scale.common import (
    ContextFilter,
    DatasetOptions,
    DatasetResult,
    Progress,
    finish,
    prepare_output,
    tokenize_row,
)
from seqkv_cli.scale.plan import KeyStats
from seqkv_cli.scale.shard import ShardSession, build_shard


def compress_dataset(
    inputs,
    out_dir,
    model=None,
    *,
    options: DatasetOptions | None = None,
    ray_address: str | None = None,
    workers: int = 1,
    cpus_per_worker: float = 1.0,
    gpus_per_worker: float = 0.0,
    on_progress: Callable[[str], None] | None = None,
) -> DatasetResult:
    """Compress the sessions of JSONL/Parquet files into shards under `out_dir`.

    Without `ray_address` the shards are built one after another in this process (the whole
    tokenized input is held in memory: 4 bytes a token); with it, on Ray Data (ray_data.py):
    "local" starts a cluster on this machine, "auto" joins a running one, or an address."""
    from seqkv_cli.kvcapture.rows import check_ids, iter_dataset
    from seqkv_cli.runtime.loading import resolve_model
    from seqkv_cli.scale.plan import plan_shards, prefix_key

    options = options or DatasetOptions()
    if options.prefix_tokens < 1:
        raise SeqkvError(f"--prefix-tokens must be at least 1, got {options.prefix_tokens}")
    paths = [Path(p) for p in ([inputs] if isinstance(inputs, str | Path) else inputs)]
    if not paths:
        raise SeqkvError("no inputs given")
    root = Path(out_dir)
    started = time.monotonic()
    check_ids(paths)  # streamed: a bad id is refused before any model is loaded
    if ray_address is not None:
        from seqkv_cli.scale.ray_data import compress_on_ray

        return compress_on_ray(
            paths,
            root,
            model,
            options,
            ray_address,
            workers,
            cpus_per_worker,
            gpus_per_worker,
            on_progress,
            started,
        )
    lm = resolve_model(model)
    prepare_output(root, paths, lm.fingerprint)
    by_key: dict[str, list] = defaultdict(list)
    fits = ContextFilter(lm.max_context, options.strict)
    for row in iter_dataset(paths):
        ids = tokenize_row(lm, row)
        if fits.keep(row.where, row.id, len(ids)):
            key = prefix_key(ids, options.prefix_tokens)
            by_key[key].append((row.id, np.asarray(ids, dtype=np.int32)))
    if not by_key:
        raise fits.nothing_left()
    stats = {k: KeyStats(len(v), sum(len(t) for _, t in v)) for k, v in by_key.items()}
    plan = plan_shards(stats, max_sessions=options.shard_sessions, max_tokens=options.shard_tokens)
    shards: dict[str, list] = defaultdict(list)
    for key, items in by_key.items():
        for sid, ids in items:
            shards[plan.shard_of(key, sid)].append(ShardSession(sid, ids.astype(np.int64), key))
    progress, rows = Progress(started=started), []
    for name in sorted(shards):
        members = shards[name]
        shard_rows, skipped = build_shard(root / name, name, members, lm, options.shard_options())
        rows.extend(shard_rows)
        progress.shards += 1
        progress.skipped_shards += int(skipped)
        progress.sessions += len(members)
        progress.tokens += sum(len(s.token_ids) for s in members)
        progress.bytes += (root / name).stat().st_size
        if on_progress:
            on_progress(progress.line(len(shards)))
    meta = {"prefix_tokens": options.prefix_tokens, "too_long_skipped": fits.skipped}
    manifest, removed, file_bytes = finish(root, rows, lm, set(shards), meta)
    return DatasetResult(
        root,
        manifest,
        progress.sessions,
        progress.tokens,
        file_bytes,
        len(shards),
        progress.skipped_shards,
        fits.skipped,
        removed,
        time.monotonic() - started,
    )


def compress_dataset_to_file(inputs, out, model=None, options: DatasetOptions | None = None):
    """All sessions of the datasets in one archive at `out` (no sharding): a CompressResult.
    Sessions longer than the model context are skipped (refused with `strict`)."""
    from seqkv_cli.api.sessions import compress_sessions
    from seqkv_cli.kvcapture.rows import check_ids, iter_dataset
    from seqkv_cli.runtime.loading import resolve_model

    options = options or DatasetOptions()
    paths = [Path(p) for p in ([inputs] if isinstance(inputs, str | Path) else inputs)]
    check_ids(paths)
    lm = resolve_model(model)
    sessions, fits = [], ContextFilter(lm.max_context, options.strict)
    for row in iter_dataset(paths):
        ids = tokenize_row(lm, row)
        if fits.keep(row.where, row.id, len(ids)):
            sessions.append((row.id, np.asarray(ids, dtype=np.int64)))
    if not sessions:
        raise fits.nothing_left()
    return compress_sessions(
        sessions, out, lm, codec=options.codec, numerics=options.numerics, verify=options.verify
    )
