"""The sharded pipeline on Ray Data: actors hold the model, one `.skv` per shard, a manifest.

    rows (read_text for JSONL, read_parquet) --map_batches(TokenizeRows: actors)--> id,
    token ids, prefix key  --(driver: per-key counts -> shard plan)--> shard name per row
    --groupby(shard).map_groups(CompressShard: actors, num_gpus=...)--> one shard's bytes
    --write_datasink(ShardSink)--> shard files published atomically; manifest on completion

Ray retries a failed actor (`max_restarts`, `max_task_retries`); a shard that is already on
disk holding provably what this run would write (shard.py: ids, lengths, a digest of each
session's tokens, model and codec) is not rebuilt, so a rerun after a crash redoes only what
was lost, and a rerun after an edit rewrites the edited sessions' shards. The output
directory must be one every node sees (a shared file system).

This module is the driver's side: joining the cluster, and `RayShards`, the backend that
`local.compress_dataset` drives; the stages that run on the cluster are in ray_stages.py.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path

from seqkv_cli.errors import SeqkvError
from seqkv_cli.scale.common import Progress
from seqkv_cli.scale.ray_stages import (
    ROW_WHERE,
    CompressShard,
    TokenizeRows,
    Tracker,
    assign,
    make_sink,
    read_rows,
)

RETRIES = 3
PROGRESS_ACTOR = "seqkv-progress"


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


class RayShards:
    """The backend on Ray Data (the steps of the module note); `local.compress_dataset`
    drives it."""

    def __init__(self, model, address: str, workers: int, cpus: float, gpus: float) -> None:
        if model is not None and not isinstance(model, str | Path):
            raise SeqkvError(
                "with Ray the model is given as a folder or .gguf path (actors load it)"
            )
        if workers < 1 or cpus <= 0 or gpus < 0:
            raise SeqkvError(
                "--workers must be >= 1, --cpus-per-worker > 0, --gpus-per-worker >= 0"
            )
        if address not in ("local", "auto"):
            _reachable(address)  # ray.init would retry an address nobody answers for minutes
        _ray()
        # actors load the model themselves: a local path is made absolute (their cwd differs)
        spec = None if model is None else str(model)
        if spec is not None and Path(spec).exists():
            spec = str(Path(spec).resolve())
        self.spec, self.address = spec, address
        self.workers, self.cpus, self.gpus = workers, cpus, gpus
        self.lm = self.ray = self.tracker = self.tokens = None
        self.tracker_name = ""

    def load_model(self):
        """The driver's own copy: it checks the model and the output before the cluster works."""
        from seqkv_cli.runtime.loading import load_model

        self.lm = load_model(self.spec)
        return self.lm

    @contextlib.contextmanager
    def running(self):
        """Connected, with the progress tracker; a Ray error becomes one SeqkvError line."""
        ray = self.ray = connect(self.address, self.workers * self.cpus)
        from ray.data import DataContext
        from ray.data.context import ShuffleStrategy

        ctx = DataContext.get_current()
        saved = ctx.shuffle_strategy, ctx.enable_progress_bars
        # The sort shuffle needs no long-lived aggregator actors, which on a small cluster
        # would hold the CPUs the compress actors wait for.
        ctx.shuffle_strategy = ShuffleStrategy.SORT_SHUFFLE_PULL_BASED
        ctx.enable_progress_bars = False
        self.tracker_name = f"{PROGRESS_ACTOR}-{os.getpid()}-{time.monotonic_ns()}"
        self.tracker = ray.remote(num_cpus=0)(Tracker).options(name=self.tracker_name).remote()
        try:
            yield
        except SeqkvError:
            raise
        except Exception as exc:  # a Ray task error wraps ours: show its last line, not a trace
            raise SeqkvError(f"the Ray run failed: {_last_line(exc)}") from None
        finally:
            ctx.shuffle_strategy, ctx.enable_progress_bars = saved
            ray.kill(self.tracker)

    def tokenize(self, paths, prefix_tokens: int, keep, fits=None) -> None:
        from ray.data import ActorPoolStrategy

        from seqkv_cli.scale.common import TokenizedSession

        self.tokens = (
            read_rows(self.ray, paths)
            .map_batches(
                TokenizeRows,
                fn_constructor_args=(self.spec, prefix_tokens),
                compute=ActorPoolStrategy(size=self.workers),
                num_cpus=self.cpus,
                batch_format="pandas",
            )
            .materialize()
        )
        columns = self.tokens.select_columns(["id", "n", "key"])
        for batch in columns.iter_batches(batch_format="numpy"):
            for sid, n, key in zip(batch["id"], batch["n"], batch["key"], strict=True):
                keep(TokenizedSession(ROW_WHERE, str(sid), int(n), str(key)))

    def build(self, root: Path, plan, options: dict, progress: Progress, on_progress):
        from ray.data import ActorPoolStrategy

        from seqkv_cli.runtime.devices import requested

        assigned = self.tokens.map_batches(
            assign,
            fn_kwargs={"names_of": plan.names_of, "max_context": self.lm.max_context},
            batch_format="numpy",
        )
        threads = max(1, int(self.cpus))
        shards = assigned.groupby("shard").map_groups(
            CompressShard,
            fn_constructor_args=(self.spec, str(root), options, threads, requested()),
            compute=ActorPoolStrategy(size=self.workers),
            num_cpus=self.cpus,
            num_gpus=self.gpus,
            batch_format="pandas",
            max_restarts=RETRIES,
            max_task_retries=RETRIES,
        )
        sink = make_sink(root, self.tracker_name)
        total = len(set(n for names in plan.names_of.values() for n in names))
        stop = threading.Event()
        watcher = threading.Thread(
            target=_report,
            args=(self.ray, self.tracker, total, progress.started, stop, on_progress),
            daemon=True,
        )
        watcher.start()
        try:
            shards.write_datasink(sink)
        finally:
            stop.set()
            watcher.join()
        done = self.ray.get(self.tracker.get.remote())
        return sink.rows, done["skipped"]


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
