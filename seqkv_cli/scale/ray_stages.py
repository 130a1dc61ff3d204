"""The stages of the Ray Data pipeline, as they run on the cluster (ray_data.py drives them):
rows read as JSON text, the tokenizing actors, each row's shard, the compressing actors, the
Datasink that publishes shards, and the counter the driver's progress line reads."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

ROW_WHERE = "dataset row"  # what messages name a row by (Ray's rows carry no file or line)


class TokenizeRows:
    """Ray actor: rows -> id, token ids, length, prefix key (the model's tokenizer, once)."""

    def __init__(self, model_spec, prefix_tokens: int) -> None:
        from seqkv_cli.runtime.loading import load_model

        self.lm = load_model(model_spec)
        self.prefix_tokens = prefix_tokens

    def __call__(self, batch: dict) -> dict:
        from seqkv_cli.kvcapture.engine import SessionTooLong
        from seqkv_cli.kvcapture.rows import row_from_mapping
        from seqkv_cli.scale.common import tokenize_row
        from seqkv_cli.scale.plan import prefix_key

        out = {"id": [], "token_ids": [], "n": [], "key": []}
        for obj in _records(batch):
            row = row_from_mapping(obj, ROW_WHERE)
            try:
                ids, n = tokenize_row(self.lm, row), None
            except SessionTooLong as exc:  # the driver's context filter skips or refuses it
                ids, n = [], exc.at_least
            out["id"].append(row.id)
            out["token_ids"].append(np.asarray(ids, dtype=np.int32))
            out["n"].append(len(ids) if n is None else n)
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

        from seqkv_cli.scale.shard import (
            ShardSession,
            build_shard,
            manifest_rows,
            provably_complete,
            shard_settings,
        )

        name = str(group["shard"].iloc[0])
        sessions = [
            ShardSession(str(i), np.asarray(t, dtype=np.int64), str(k))
            for i, t, k in zip(group["id"], group["token_ids"], group["key"], strict=True)
        ]
        final = self.root / name
        if provably_complete(final, sessions, shard_settings(self.lm, self.options)):
            rows = manifest_rows(final, name, {s.id: s.prefix_key for s in sessions})
            return _result(name, None, rows, sessions)
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


def read_rows(ray, paths):
    """The input files as a dataset of one JSON text a row."""
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


def assign(batch: dict, names_of: dict, max_context: int) -> dict:
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
