"""`compress_dataset`: a session dataset -> a directory of shard archives + a manifest.

One driver, two backends (this process, or Ray Data: ray_data.py). Steps: ids are checked
over the whole input before any model work (a missing or repeated id is refused, naming its
row); the backend tokenizes the sessions and keys them by their first tokens; the per-key
counts give the shard plan (plan.py); the backend builds every shard (shard.py) and publishes
it atomically; the manifest is written last. A rerun over the same input skips the shards
that provably hold what it would write (shard.py), and removes shard files no longer in the
plan.

A backend has four steps: `load_model()`, `running()` (a context around the work),
`tokenize(paths, prefix_tokens, keep)` (`keep(TokenizedSession)` says whether the session is
planned) and `build(root, plan, options, progress, on_progress)` (manifest rows, shards
skipped as complete).
"""

from __future__ import annotations

import contextlib
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
    TokenizedSession,
    finish,
    prepare_output,
    tokenize_row,
)
from seqkv_cli.scale.plan import KeyStats
from seqkv_cli.scale.shard import ShardSession, shard_settings


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
    from seqkv_cli.fsutil import remove_created_dirs
    from seqkv_cli.kvcapture.rows import check_ids

    options = options or DatasetOptions()
    if options.prefix_tokens < 1:
        raise SeqkvError(f"--prefix-tokens must be at least 1, got {options.prefix_tokens}")
    paths = [Path(p) for p in ([inputs] if isinstance(inputs, str | Path) else inputs)]
    if not paths:
        raise SeqkvError("no inputs given")
    root = Path(out_dir)
    started = time.monotonic()
    check_ids(paths)  # streamed: a bad id is refused before any model is loaded
    if ray_address is None:
        backend = SerialShards(model)
    else:
        from seqkv_cli.scale.ray_data import RayShards

        backend = RayShards(model, ray_address, workers, cpus_per_worker, gpus_per_worker)
    lm = backend.load_model()
    created = prepare_output(root, paths, lm.fingerprint)
    try:
        rows, skipped, fits = _run(backend, paths, root, options, started, lm, on_progress)
        names = {r["shard"] for r in rows}  # the shards written (a split key's may be fewer)
        meta = {
            "prefix_tokens": options.prefix_tokens,
            "too_long_skipped": fits.skipped,
            "settings": shard_settings(lm, options.shard_options()),
        }
        manifest, removed, file_bytes = finish(root, rows, lm, names, meta)
    except BaseException:
        remove_created_dirs(created)  # only if nothing was published in them
        raise
    return DatasetResult(
        root,
        manifest,
        len(rows),
        sum(r["tokens"] for r in rows),
        file_bytes,
        len(names),
        skipped,
        fits.skipped,
        removed,
        time.monotonic() - started,
    )


def _run(backend, paths, root: Path, options: DatasetOptions, started, lm, on_progress):
    """Tokenize, plan and build every shard: the manifest rows, the shards skipped as
    complete, and the context filter (what it skipped)."""
    from seqkv_cli.scale.plan import plan_shards

    fits = ContextFilter(lm.max_context, options.strict)
    counts: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # key -> sessions, tokens

    def keep(session: TokenizedSession) -> bool:
        if not fits.keep(session.where, session.id, session.tokens):
            return False
        counts[session.key][0] += 1
        counts[session.key][1] += session.tokens
        return True

    with backend.running():
        backend.tokenize(paths, options.prefix_tokens, keep, fits)
        if not counts:
            raise fits.nothing_left()
        plan = plan_shards(
            {k: KeyStats(*v) for k, v in counts.items()},
            max_sessions=options.shard_sessions,
            max_tokens=options.shard_tokens,
        )
        progress = Progress(started=started)
        rows, skipped = backend.build(root, plan, options.shard_options(), progress, on_progress)
    return rows, skipped, fits


class SerialShards:
    """The backend in this process: the tokenized sessions held in memory, shards built one
    after another."""

    def __init__(self, model) -> None:
        self.model, self.lm = model, None
        self.by_key: dict[str, list] = defaultdict(list)  # key -> (id, int32 token ids)

    def load_model(self):
        from seqkv_cli.runtime.loading import resolve_model

        self.lm = resolve_model(self.model)
        return self.lm

    def running(self):
        return contextlib.nullcontext()

    def tokenize(self, paths, prefix_tokens: int, keep, fits: ContextFilter) -> None:
        from seqkv_cli.kvcapture.rows import iter_dataset
        from seqkv_cli.scale.plan import prefix_key

        for row in iter_dataset(paths):
            ids = tokenize_row(self.lm, row, fits)
            if ids is None:  # longer than the context: skipped and counted
                continue
            key = prefix_key(ids, prefix_tokens)
            if keep(TokenizedSession(row.where, row.id, len(ids), key)):
                self.by_key[key].append((row.id, np.asarray(ids, dtype=np.int32)))

    def build(self, root: Path, plan, options: dict, progress: Progress, on_progress):
        from seqkv_cli.scale.shard import build_shard

        shards: dict[str, list] = defaultdict(list)
        for key, items in self.by_key.items():
            for sid, ids in items:
                shards[plan.shard_of(key, sid)].append(ShardSession(sid, ids.astype(np.int64), key))
        rows = []
        for name in sorted(shards):
            members = shards[name]
            shard_rows, skipped = build_shard(root / name, name, members, self.lm, options)
            rows.extend(shard_rows)
            progress.shards += 1
            progress.skipped_shards += int(skipped)
            progress.sessions += len(members)
            progress.tokens += sum(len(s.token_ids) for s in members)
            progress.bytes += (root / name).stat().st_size
            if on_progress:
                on_progress(progress.line(len(shards)))
        return rows, progress.skipped_shards


def compress_dataset_to_file(inputs, out, model=None, options: DatasetOptions | None = None):
    """All sessions of the datasets in one archive at `out` (no sharding): a CompressResult.
    Sessions longer than the model context are skipped (refused with `strict`)."""
    from seqkv_cli.api import compress_sessions
    from seqkv_cli.kvcapture.rows import check_ids, iter_dataset
    from seqkv_cli.runtime.loading import resolve_model

    options = options or DatasetOptions()
    paths = [Path(p) for p in ([inputs] if isinstance(inputs, str | Path) else inputs)]
    check_ids(paths)
    lm = resolve_model(model)
    sessions, fits = [], ContextFilter(lm.max_context, options.strict)
    for row in iter_dataset(paths):
        ids = tokenize_row(lm, row, fits)
        if ids is not None and fits.keep(row.where, row.id, len(ids)):
            sessions.append((row.id, np.asarray(ids, dtype=np.int64)))
    if not sessions:
        raise fits.nothing_left()
    return compress_sessions(
        sessions, out, lm, codec=options.codec, numerics=options.numerics, verify=options.verify
    )
