"""The suite's (`bench.suite.run`) shared pieces: the run every section gets, and compress and
restore timed the same way for every section. The command line, environment, clock and
publish of every bench are `bench.harness`'s.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.harness import timed

KV_BITS_16 = 16  # fp16/bf16 bits per K/V component: the "ratio vs fp16" baseline


@dataclass
class Run:
    """What every bench section gets: the model, a scratch folder, the size mode, a clock."""

    lm: object
    folder: Path
    quick: bool
    started: float = field(default_factory=time.perf_counter)

    def log(self, message: str) -> None:
        """One progress line with the time since the run started (the full run is ~30 min)."""
        print(f"[{time.perf_counter() - self.started:7.1f} s] {message}", flush=True)

    def scratch(self, name: str) -> Path:
        path = self.folder / name
        path.mkdir(parents=True, exist_ok=True)
        return path


def compress(run: Run, paths: list[Path], out: Path, codec: str | dict):
    """`compress_captures` with check off (decode is timed on its own): (result, seconds)."""
    from seqkv_cli.archive import compress_captures

    return timed(lambda: compress_captures(paths, out, codec=codec, model=run.lm, check=False))


def restore(run: Run, skv: Path, session_ids: list[str]) -> tuple[list, float]:
    """The sessions of an archive restored by the library, in the order of `session_ids`
    (a trie archive yields sessions as they finish, not in file order), and the seconds."""
    from seqkv_cli.archive import Archive

    with Archive(skv, model=run.lm) as arc:
        if arc.needs_model:
            arc.canonical()  # built once per model; not part of the decode time
        pairs, seconds = timed(lambda: list(arc.restore_many(arc.sessions)))
    failed = [r for _, r in pairs if isinstance(r, Exception)]
    if failed:
        raise SystemExit(f"{Path(skv).name}: restore failed: {failed[0]}")
    by_id = {entry["id"]: r for entry, r in pairs}
    if sorted(by_id) != sorted(session_ids):
        raise SystemExit(f"{Path(skv).name}: restored {sorted(by_id)}, not {session_ids}")
    return [by_id[s] for s in session_ids], seconds


def fp16_bits_per_position(lm) -> int:
    """Bits one position of K/V takes at 16 bits per component (layers x 2 x heads x dim)."""
    return lm.num_layers * 2 * lm.num_kv_heads * lm.head_dim * KV_BITS_16


def restore_all(lm, path: Path) -> tuple[dict, float, object]:
    """Every session of an archive restored by the library, the model's set-up outside the
    clock: ({session id: restored capture or error}, seconds, the archive's decode_stats)."""
    from seqkv_cli.archive import Archive

    with Archive(path, model=lm) as arc:
        arc.canonical()  # model set-up is not decode time
        pairs, seconds = timed(lambda: list(arc.restore_many(arc.sessions)))
        stats = arc.decode_stats
    return {e["id"]: r for e, r in pairs}, seconds, stats
