"""The sharded pipeline on Ray Data: actors hold the model, one `.skv` per shard, a manifest.

    rows (read_text for JSONL, read_parquet) --map_batches(TokenizeRows: actors)--> id,
    token ids, prefix key  --(driver: per-key counts -> shard plan)--> shard name per row
    --groupby(shard).map_groups(CompressShard: actors, num_gpus=...)--> one shard's bytes
    --write_datasink(ShardSink)--> shard files published atomically; manifest on completion

Ray retries a failed actor (`max_restarts`, `max_task_retries`); a shard that is already on
disk with exactly its planned sessions is not rebuilt, so a rerun after a crash redoes only
what was lost. The output directory must be one every node sees (a shared file system).
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import numpy as np

from seqkv_cli.errors import SeqkvError
from seqkv_cli.scale.common import Progress

RETRIES = 3
PROGRESS_ACTOR = "seqkv-progress"
# Test-only fault injection: an actor compressing a shard whose path contains this value
# exits hard once (the marker file beside the output remembers it) so Ray must retry it.
KILL_SHARD_ENV = "SEQKV_TEST_KILL_SHARD"


def _ray():
    try:
        import ray
        import ray.data
    except ImportError:
        raise SeqkvError(
            "--ray needs Ray Data: pip install 'seqkv[ray]' (or 'ray[data]')"
        ) from None
    return ray


def connect(address: str, cpus_needed: float):
    """Join the cluster at `address` ("auto": a running one) or start one here ("local")."""
    ray = _ray()
    if ray.is_initialized():
        return ray
    try:
        if address == "local":
            ray.init(
                num_cpus=max(os.cpu_count() or 1, int(cpus_needed) + 1),
                include_dashboard=False,
                log_to_driver=False,
                configure_logging=False,
            )
        else:
            ray.init(address=address, log_to_driver=False, configure_logging=False)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SeqkvError(f"cannot reach the Ray cluster at {address}: {first[:200]}") from None
    return ray


def _reachable(address: str, timeout: float = 5.0) -> None:
    """Refuse at once an address with no listener (`host:port` or `ray://host:port`)."""
    import socket

    where = address.split("://", 1)[-1].rstrip("/")
    host, sep, port = where.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise SeqkvError(f"--ray {address!r}: give 'local', 'auto', HOST:PORT or ray://HOST:PORT")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            pass
    except OSError as exc:
        why = exc.strerror or type(exc).__name__
        raise SeqkvError(f"cannot reach the Ray cluster at {address}: {why}") from None


class TokenizeRows:
    """Ray actor: rows -> id, token ids, length, prefix key (the model's tokenizer, once)."""

    def __init__(self, model_spec, prefix_tokens: int) -> None:
        from seqkv_cli.runtime.loading import load_model

        self.lm = load_model(model_spec)
        self.prefix_tokens = prefix_tokens

    def __call__(self, batch: dict) -> dict:
        from seqkv_cli.kvcapture.rows import row_from_mapping
        from seqkv_cli.scale.common import tokenize_row
        from seqkv_cli.scale.plan import prefix_key

        out = {"id": [], "token_ids": [], "n": [], "key": []}
        for obj in _records(batch):
            row = row_from_mapping(obj, "dataset row")
            ids = tokenize_row(self.lm, row)
            out["id"].append(row.id)
            out["token_ids"].append(np.asarray(ids, dtype=np.int32))
            out["n"].append(len(ids))
            out["key"].append(prefix_key(ids, self.prefix_tokens))
        return {
            "id": np.array(out["id"], dtype=object),
            "token_ids": _object_array(out["token_ids"]),
            "n": np.array(out["n"], dtype=np.int64),
            "key": np.array(out["key"], dtype=object),
        }


class CompressShard:
    """Ray actor: holds the model; one call gets one shard's rows and returns its file bytes
    (None when the shard is already complete on disk) and its manifest rows."""

    def __init__(
        self, model_spec, root: str, options: dict, threads: int, device: str = "cpu"
    ) -> None:
        import torch

        from seqkv_cli.runtime.devices import use_device
        from seqkv_cli.runtime.loading import load_model

        torch.set_num_threads(max(1, threads))
        use_device(device)  # "auto": the GPU Ray assigned (--gpus-per-worker), else the CPU
        self.lm = load_model(model_spec)
        self.root = Path(root)
        self.options = options

    def __call__(self, group) -> dict:
        import tempfile

        from seqkv_cli.scale.shard import ShardSession, build_shard, holds_exactly, manifest_rows

        name = str(group["shard"].iloc[0])
        sessions = [
            ShardSession(str(i), np.asarray(t, dtype=np.int64), str(k))
            for i, t, k in zip(group["id"], group["token_ids"], group["key"], strict=True)
        ]
        final = self.root / name
        if holds_exactly(final, sessions):
            rows = manifest_rows(final, name, {s.id: s.prefix_key for s in sessions})
            return _result(name, None, rows, sessions)
        _maybe_die(name, self.root)
        with tempfile.TemporaryDirectory(prefix="seqkv-shard-") as tmp:
            built = Path(tmp) / name
            rows, _ = build_shard(built, name, sessions, self.lm, self.options)
            data = built.read_bytes()
        return _result(name, data, rows, sessions)


class Tracker:
    """Ray actor (no CPU): sessions, tokens and bytes published so far, for the driver."""

    def __init__(self) -> None:
        self.done = {"sessions": 0, "tokens": 0, "bytes": 0, "shards": 0, "skipped": 0}

    def add(self, **counts) -> None:
        for k, v in counts.items():
            self.done[k] += int(v)

    def get(self) -> dict:
        return dict(self.done)


def make_sink(root: Path, tracker_name: str):
    from ray.data import Datasink

    class ShardSink(Datasink):
        """Writes each shard's bytes to `root/<shard>` (temporary file, fsync, rename) and
        returns the manifest rows; the driver writes the manifest once all are in."""

        def __init__(self) -> None:
            self.root = Path(root)
            self.rows: list[dict] = []

        def write(self, blocks, ctx):
            import ray

            from seqkv_cli.fsutil import atomic_path

            tracker = ray.get_actor(tracker_name)
            rows = []
            for block in blocks:
                for rec in _records(_columns(block)):
                    name, data = str(rec["shard"]), rec["data"]
                    if data is not None and len(data):
                        with atomic_path(self.root / name) as tmp:
                            tmp.write_bytes(bytes(data))
                    shard_rows = json.loads(rec["rows"])
                    rows.extend(shard_rows)
                    tracker.add.remote(
                        sessions=len(shard_rows),
                        tokens=sum(r["tokens"] for r in shard_rows),
                        bytes=(self.root / name).stat().st_size,
                        shards=1,
                        skipped=int(data is None or not len(data)),
                    )
            return rows

        def on_write_complete(self, result) -> None:
            returns = getattr(result, "write_returns", result)
            self.rows = [r for part in returns for r in (part or [])]

    return ShardSink()


def compress_on_ray(
    paths, root, model, options, address, workers, cpus, gpus, on_progress, started
):
    from seqkv_cli.runtime.loading import load_model
    from seqkv_cli.scale.common import ContextFilter, DatasetResult, finish, prepare_output
    from seqkv_cli.scale.plan import KeyStats, plan_shards

    if model is not None and not isinstance(model, str | Path):
        raise SeqkvError("with Ray the model is given as a folder or .gguf path (actors load it)")
    if workers < 1 or cpus <= 0 or gpus < 0:
        raise SeqkvError("--workers must be >= 1, --cpus-per-worker > 0, --gpus-per-worker >= 0")
    if address not in ("local", "auto"):
        _reachable(address)  # ray.init would retry an address nobody answers for minutes
    _ray()
    # actors load the model themselves: a local path is made absolute (their cwd differs)
    spec = None if model is None else str(model)
    if spec is not None and Path(spec).exists():
        spec = str(Path(spec).resolve())
    lm = load_model(spec)  # the driver checks the model and the output before the cluster works
    prepare_output(root, paths, lm.fingerprint)
    ray = connect(address, workers * cpus)
    from ray.data import ActorPoolStrategy, DataContext
    from ray.data.context import ShuffleStrategy

    ctx = DataContext.get_current()
    saved = ctx.shuffle_strategy, ctx.enable_progress_bars
    # The sort shuffle needs no long-lived aggregator actors, which on a small cluster would
    # hold the CPUs the compress actors wait for.
    ctx.shuffle_strategy, ctx.enable_progress_bars = ShuffleStrategy.SORT_SHUFFLE_PULL_BASED, False
    tracker_name = f"{PROGRESS_ACTOR}-{os.getpid()}-{time.monotonic_ns()}"
    tracker = ray.remote(num_cpus=0)(Tracker).options(name=tracker_name).remote()
    try:
        rows_ds = _read(ray, paths)
        tokens = rows_ds.map_batches(
            TokenizeRows,
            fn_constructor_args=(spec, options.prefix_tokens),
            compute=ActorPoolStrategy(size=workers),
            num_cpus=cpus,
            batch_format="pandas",
        ).materialize()
        stats: dict[str, list[int]] = {}
        fits = ContextFilter(lm.max_context, options.strict)
        for batch in tokens.select_columns(["id", "n", "key"]).iter_batches(batch_format="numpy"):
            for sid, n, key in zip(batch["id"], batch["n"], batch["key"], strict=True):
                if fits.keep("dataset", str(sid), int(n)):
                    s = stats.setdefault(str(key), [0, 0])
                    s[0] += 1
                    s[1] += int(n)
        if not stats:
            raise fits.nothing_left()
        plan = plan_shards(
            {k: KeyStats(*v) for k, v in stats.items()},
            max_sessions=options.shard_sessions,
            max_tokens=options.shard_tokens,
        )
        assigned = tokens.map_batches(
            _assign,
            fn_kwargs={"names_of": plan.names_of, "max_context": lm.max_context},
            batch_format="numpy",
        )
        threads = max(1, int(cpus))
        from seqkv_cli.runtime.devices import requested

        device = requested()
        shards = assigned.groupby("shard").map_groups(
            CompressShard,
            fn_constructor_args=(spec, str(root), options.shard_options(), threads, device),
            compute=ActorPoolStrategy(size=workers),
            num_cpus=cpus,
            num_gpus=gpus,
            batch_format="pandas",
            max_restarts=RETRIES,
            max_task_retries=RETRIES,
        )
        sink = make_sink(root, tracker_name)
        total = len(set(n for names in plan.names_of.values() for n in names))
        stop = threading.Event()
        watcher = threading.Thread(
            target=_report, args=(ray, tracker, total, started, stop, on_progress), daemon=True
        )
        watcher.start()
        try:
            shards.write_datasink(sink)
        finally:
            stop.set()
            watcher.join()
        done = ray.get(tracker.get.remote())
    except SeqkvError:
        raise
    except Exception as exc:  # a Ray task error wraps ours: show its last line, not a trace
        raise SeqkvError(f"the Ray run failed: {_last_line(exc)}") from None
    finally:
        ctx.shuffle_strategy, ctx.enable_progress_bars = saved
        ray.kill(tracker)
    names = set(n for names in plan.names_of.values() for n in names)
    meta = {"prefix_tokens": options.prefix_tokens, "too_long_skipped": fits.skipped}
    manifest, removed, file_bytes = finish(root, sink.rows, lm, names, meta)
    return DatasetResult(
        Path(root),
        manifest,
        len(sink.rows),
        sum(r["tokens"] for r in sink.rows),
        file_bytes,
        len(names),
        done["skipped"],
        fits.skipped,
        removed,
        time.monotonic() - started,
    )


def _read(ray, paths):
    jsonl = [str(p) for p in paths if p.suffix.lower() == ".jsonl"]
    parquet = [str(p) for p in paths if p.suffix.lower() == ".parquet"]
    parts = []
    if jsonl:  # one JSON text a row, parsed by the same checks as the serial reader
        parts.append(ray.data.read_text(jsonl, drop_empty_lines=True).map_batches(_parse_json))
    if parquet:
        parts.append(ray.data.read_parquet(parquet).map_batches(_as_json))
    return parts[0] if len(parts) == 1 else parts[0].union(*parts[1:])


def _parse_json(batch: dict) -> dict:
    return {"json": np.array(list(batch["text"]), dtype=object)}


def _as_json(batch: dict) -> dict:
    import pandas as pd

    frame = pd.DataFrame(batch)
    records = [
        {k: _plain(v) for k, v in rec.items() if k in ("id", "messages", "text", "token_ids")}
        for rec in frame.to_dict("records")
    ]
    return {"json": np.array([json.dumps(r) for r in records], dtype=object)}


def _plain(value):
    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value.tolist()]
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, np.generic):
        return value.item()
    if value is None or (isinstance(value, float) and value != value):
        return None
    return value


def _records(batch):
    """The rows of a batch (dict of columns or a DataFrame) as dicts."""
    if hasattr(batch, "to_dict"):
        batch = {c: list(batch[c]) for c in batch.columns}
    if "json" in batch:
        return [json.loads(text) for text in batch["json"]]
    names = list(batch)
    count = len(batch[names[0]]) if names else 0
    return [{n: batch[n][i] for n in names} for i in range(count)]


def _columns(block) -> dict:
    if hasattr(block, "to_pydict"):
        return block.to_pydict()
    return {c: list(block[c]) for c in block.columns}


def _assign(batch: dict, names_of: dict, max_context: int) -> dict:
    """Each row's shard; rows longer than the model context (counted already) are dropped."""
    from seqkv_cli.scale.plan import ShardPlan

    plan = ShardPlan(names_of)
    keep = np.asarray(batch["n"]) <= max_context
    kept = {name: np.asarray(col, dtype=object)[keep] for name, col in batch.items()}
    kept["n"] = np.asarray(batch["n"])[keep]
    shard = [plan.shard_of(str(k), str(i)) for k, i in zip(kept["key"], kept["id"], strict=True)]
    return {**kept, "shard": np.array(shard, dtype=object)}


def _object_array(items: list) -> np.ndarray:
    arr = np.empty(len(items), dtype=object)
    arr[:] = items
    return arr


def _result(name: str, data: bytes | None, rows: list[dict], sessions) -> dict:
    return {
        "shard": [name],
        "data": [data],
        "rows": [json.dumps(rows)],
        "sessions": [len(sessions)],
    }


def _maybe_die(name: str, root: Path) -> None:
    target = os.environ.get(KILL_SHARD_ENV)
    if not target or target not in str(root / name):
        return
    marker = root / f".killed-{name}"
    if marker.exists():
        return
    marker.write_text("killed once by the fault-injection test hook\n")
    import signal

    os.kill(os.getpid(), signal.SIGKILL)


def _report(ray, tracker, total, started, stop, on_progress) -> None:
    last = None
    while not stop.wait(2.0):
        if on_progress is None:
            continue
        try:
            d = ray.get(tracker.get.remote(), timeout=5)
        except Exception:  # progress is best effort; the run's own errors surface elsewhere
            continue
        if d != last:
            last = d
            on_progress(Progress.of(d, started).line(total))


def _last_line(exc: BaseException) -> str:
    text = str(exc).strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "SeqkvError" in ln:
            return ln.split("SeqkvError:", 1)[-1].strip()[:300]
    return (lines[-1] if lines else type(exc).__name__)[:300]
