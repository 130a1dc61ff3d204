"""Write the golden files of format 1.9 (replay records in binary) ONCE.

The tokens of ../seq-portable-v3's capture "b" kept through the library API with the user's
own cache (the tiny model of ../seq-v1/model as a transformers fp32 model), three turns each
continuing the cache before by a prefill and single steps: "replay-turns" (a compact archive
rewritten in the full layout at turn 2, each later record inheriting the environment and its
parent's calls), "replay-compacted" (the same turns after `archive compact`: a compact archive
whose shorter turns name the longest and drop its last calls) and "replay-one" (the first turn
alone: a one-session compact archive). expected.json holds every session's record as a reader
gives it back. Never re-run this to make a failing golden test pass.
Usage: python -m tests.golden.make_golden_replay tests/golden/replay-v1
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import torch

from seqkv_cli.kvcapture.capture_file import load_capture

HERE = Path(__file__).resolve().parent
MODEL = HERE / "seq-v1" / "model"
CAPTURES = HERE / "seq-portable-v3" / "captures"
# each turn: the new tokens given in one prefill, then single steps
TURNS = [(20, 4), (10, 3), (8, 2)]


def main(out: Path) -> None:
    from transformers import AutoModelForCausalLM, DynamicCache

    import seqkv_cli as seqkv
    from seqkv_cli.archive import Archive, entry_record

    out.mkdir(parents=True, exist_ok=True)
    tokens = load_capture(CAPTURES / "b.safetensors").tokens.tolist()
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    cache, schedule, done = DynamicCache(config=model.config), [], 0
    path = out / "replay-turns.skv"
    for k, (prefill, steps) in enumerate(TURNS, 1):
        with torch.inference_mode():
            for n in [prefill] + [1] * steps:
                model(torch.tensor([tokens[done : done + n]]), past_key_values=cache)
                schedule.append(n)
                done += n
        os.environ["SOURCE_DATE_EPOCH"] = str(1796200000 + 5 * k)
        with seqkv.open_archive(path, model=model) as arc:
            arc.add(f"agent/turn-{k}", tokens[:done], cache=cache, schedule=list(schedule))
        if k == 1:
            shutil.copy(path, out / "replay-one.skv")
    shutil.copy(path, out / "replay-compacted.skv")
    with seqkv.open_archive(out / "replay-compacted.skv", model=model) as arc:
        arc.compact()
    expected = {}
    for name in ("replay-one", "replay-turns", "replay-compacted"):
        with Archive(out / f"{name}.skv") as arc:
            records = {e["id"]: entry_record(e) for e in arc.sessions}
            version = list(arc.reader.version)
        expected[name] = {
            "bytes": (out / f"{name}.skv").stat().st_size,
            "version": version,
            "records": records,
        }
    (out / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
