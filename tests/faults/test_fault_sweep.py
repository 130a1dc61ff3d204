"""Faults injected into every writing command (issue 37): SIGKILL, SIGTERM and SIGINT at each
checkpoint of the fault seam (fsutil.checkpoint: staging, each write, flush, close, truncate,
fsync, commit, chmod, rename or link, the directory's fsync), ENOSPC, EDQUOT and EROFS there,
and SIGKILLs at random moments; each followed by the same command again. faultkit.py says
what every case must show.

The default run takes a spread of each command's fault points (every action, each at a
different step, plus a random-moment kill); `-m slow` takes every step with every action.
With SEQKV_FAULT_COUNTS=FILE the counts are written there as JSON.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections import Counter
from pathlib import Path

import pytest
from faultkit import (
    Command,
    ForkServer,
    archive_state,
    captures_state,
    run_case,
    sharded_state,
)

from cli_run import invoke
from seqkv_cli.fsutil import STEPS
from test_data_safety import write

MODEL_ACTIONS = ("kill", "term", "enospc")


def _ok(result) -> None:
    assert result.exit_code == 0, (result.output, result.exception)


def _captures(folder: Path) -> list[Path]:
    inputs = folder / "in"
    inputs.mkdir(parents=True)
    return [write(inputs, s, s, n=9 + 5 * i, tokens=None) for i, s in enumerate("abc")]


def _rows(edited: bool) -> list[dict]:
    rows = []
    for i in range(4):
        ids = [10 + i, *range(20, 32)]
        if edited and i == 1:
            ids[8] = 99  # past the 4-token prefix key: same shard names, other content
        rows.append({"id": f"s{i}", "token_ids": ids})
    return rows


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def commands(model: Path, lm) -> list[Command]:
    m = ["--model", str(model), "--threads", "1"]

    def onto(folder):
        *_, c = _captures(folder)
        (folder / "out").mkdir()
        _ok(invoke("compress", c, "-o", folder / "out/x.skv", "--codec", "raw"))

    def new_file(folder):
        _captures(folder)
        (folder / "out").mkdir()

    def add(folder):
        a, *_ = _captures(folder)
        (folder / "out").mkdir()
        _ok(invoke("compress", a, "-o", folder / "out/x.skv", "--codec", "raw"))

    def compact(folder):
        add(folder)
        _ok(invoke("archive", "add", folder / "out/x.skv", folder / "in/b.safetensors"))
        (folder / "out/link.skv").symlink_to("x.skv")  # compacted through a symlink

    def packed(folder):
        caps = _captures(folder)
        (folder / "out").mkdir()
        _ok(invoke("compress", *caps, "-o", folder / "in/x.skv", "--codec", "raw"))

    def text(folder):
        (folder / "in").mkdir()
        (folder / "in/t.txt").write_text("A short text that the tiny model captures and codes.")
        (folder / "out").mkdir()

    def dataset(folder, single: bool):
        data = _jsonl(folder / "in/s.jsonl", _rows(edited=False))
        (folder / "out").mkdir()
        out = folder / ("out/one.skv" if single else "out/shards")
        extra = [] if single else ["--shard-sessions", "2", "--prefix-tokens", "4"]
        _ok(invoke("compress", data, "-o", out, *m, "--no-verify", *extra))
        _jsonl(data, _rows(edited=True))  # the user corrects one session, then reruns

    def api_existing(folder):
        from faultkit import api_add

        (folder / "out").mkdir()
        api_add(str(folder / "out/m.skv"), str(model), "s1", list(range(5, 25)))

    def api_turns(folder):
        from faultkit import api_add

        api_existing(folder)
        api_add(str(folder / "out/m.skv"), str(model), "s2", list(range(5, 33)))

    def skv(name, with_lm=None, kv=True):
        return lambda folder: {name: archive_state(folder / name, with_lm, kv)}

    return [
        Command(
            "compress onto a file",
            onto,
            lambda f: {
                "argv": [
                    "compress",
                    "in/a.safetensors",
                    "in/b.safetensors",
                    "-o",
                    "out/x.skv",
                    "--codec",
                    "raw",
                ]
            },
            skv("out/x.skv"),
        ),
        Command(
            "compress --layout flat",
            new_file,
            lambda f: {
                "argv": [
                    "compress",
                    "in/a.safetensors",
                    "in/b.safetensors",
                    "-o",
                    "out/y.skv",
                    "--codec",
                    "raw",
                    "--layout",
                    "flat",
                ]
            },
            skv("out/y.skv"),
        ),
        Command(
            "archive add",
            add,
            lambda f: {"argv": ["archive", "add", "out/x.skv", "in/b.safetensors"]},
            skv("out/x.skv"),
            done_already="already has a session 'b'",
        ),
        Command(
            "archive compact (through a symlink)",
            compact,
            lambda f: {"argv": ["archive", "compact", "out/link.skv"]},
            lambda f: {
                "link": (f / "out/link.skv").is_symlink(),
                "segments": _generation(f / "out/x.skv"),
                "out/x.skv": archive_state(f / "out/x.skv"),
            },
        ),
        Command(
            "archive compact (an agent's turns: a compact archive)",
            api_turns,
            lambda f: {"argv": ["archive", "compact", "out/m.skv", *m]},
            lambda f: {
                "compact archive": _is_compact_archive(f / "out/m.skv"),
                **skv("out/m.skv", lm, kv=False)(f),
            },
            MODEL_ACTIONS,
        ),
        Command(
            "decompress",
            packed,
            lambda f: {"argv": ["decompress", "in/x.skv", "-o", "out/d"]},
            lambda f: dict((captures_state(f / "out/d") or {}).items()),
        ),
        Command(
            "archive extract",
            packed,
            lambda f: {"argv": ["archive", "extract", "in/x.skv", "b", "-o", "out/b.safetensors"]},
            lambda f: dict((captures_state(f / "out") or {}).items()),
        ),
        Command(
            "report --json --csv --markdown",
            packed,
            lambda f: {
                "argv": [
                    "report",
                    "in/a.safetensors",
                    "in/b.safetensors",
                    "--codecs",
                    "raw",
                    "--json",
                    "out/r.json",
                    "--csv",
                    "out/r.csv",
                    "--markdown",
                    "out/r.md",
                ]
            },
            lambda f: {
                p.name: _report_rows(p)
                for p in sorted((f / "out").iterdir())
                if not p.name.startswith(".")
            },
        ),
        Command(
            "capture",
            text,
            lambda f: {"argv": ["capture", "in/t.txt", "-o", "out/caps", *m]},
            lambda f: dict((captures_state(f / "out/caps") or {}).items()),
            MODEL_ACTIONS,
        ),
        Command(
            "pipeline",
            text,
            lambda f: {
                "argv": [
                    "pipeline",
                    "in/t.txt",
                    "-o",
                    "out/run",
                    "--baseline",
                    "raw",
                    "--verify",
                    "none",
                    *m,
                ]
            },
            lambda f: {
                **skv("out/run/seq.skv", lm, kv=False)(f),
                **skv("out/run/raw.skv")(f),
                **(captures_state(f / "out/run/captures") or {}),
            },
            MODEL_ACTIONS,
        ),
        Command(
            "dataset compress -o DIR (after an edit)",
            lambda f: dataset(f, single=False),
            lambda f: {
                "argv": [
                    "compress",
                    "in/s.jsonl",
                    "-o",
                    "out/shards",
                    *m,
                    "--no-verify",
                    "--shard-sessions",
                    "2",
                    "--prefix-tokens",
                    "4",
                ]
            },
            lambda f: {"shards": sharded_state(f / "out/shards", lm)},
            MODEL_ACTIONS,
        ),
        Command(
            "dataset compress -o FILE (after an edit)",
            lambda f: dataset(f, single=True),
            lambda f: {"argv": ["compress", "in/s.jsonl", "-o", "out/one.skv", *m, "--no-verify"]},
            skv("out/one.skv", lm, kv=False),
            MODEL_ACTIONS,
        ),
        Command(
            "API open_archive().add, first",
            lambda f: (f / "out").mkdir(),
            lambda f: {
                "api": "add",
                "args": [str(f / "out/m.skv"), str(model), "s1", list(range(5, 25))],
            },
            skv("out/m.skv", lm, kv=False),
            ("kill", "int", "enospc"),
            api=True,
            done_already="already has a session 's1'",
        ),
        Command(
            "API open_archive().add, appended",
            api_existing,
            lambda f: {
                "api": "add",
                "args": [str(f / "out/m.skv"), str(model), "s2", [5, 6, 7, 8, 40, 41, 42]],
            },
            skv("out/m.skv", lm, kv=False),
            ("kill", "int", "enospc"),
            api=True,
            done_already="already has a session 's2'",
        ),
    ]


def _generation(path: Path) -> int:
    """How many commits the archive holds: 1 once compacted."""
    from seqkv_cli.container import open_container

    with open_container(path) as reader:
        return reader.slot.generation


def _is_compact_archive(path: Path) -> bool | None:
    """Whether the file is a compact archive (format 1.8) yet; None if it is not there."""
    from seqkv_cli.container import ContainerError, open_container

    try:
        with open_container(path) as reader:
            return bool(getattr(reader, "archive", False))
    except (ContainerError, OSError):
        return None


def _report_rows(path: Path):
    """What a report file says, without its creation time."""
    if path.suffix == ".json":
        doc = json.loads(path.read_text())
        return sorted((r["id"], r["codec"], r["positions"]) for r in doc["sessions"])
    return path.read_text().count("\n")


@pytest.fixture(scope="module")
def server():
    srv = ForkServer()
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def catalogue(tiny_model_dir, tiny_lm, tmp_path_factory, server):
    """Each command: its prepared folder, its fault points (the checkpoints a clean run
    meets), how long a clean run takes, and what its outputs hold before and after it."""
    root = tmp_path_factory.mktemp("faults")
    out = {}
    for i, command in enumerate(commands(tiny_model_dir, tiny_lm)):
        template = root / f"t{i}"
        template.mkdir()
        command.prepare(template)
        clean = root / f"c{i}"
        shutil.copytree(template, clean, symlinks=True)
        trace = root / f"trace{i}.json"
        request = dict(command.request(clean), cwd=str(clean), within=str(clean))
        done = server.run(dict(request, trace=str(trace), timeout=300))
        assert done["rc"] == 0, (command.name, done["stderr"][-2000:])
        steps = json.loads(trace.read_text())
        assert steps, f"{command.name}: a clean run met no checkpoint"
        assert {step for step, _ in steps} <= set(STEPS), steps
        print(f"{command.name}: {len(steps)} checkpoints, {done['seconds']:.2f} s")
        old, new = command.state(template), command.state(clean)
        assert old != new, f"{command.name}: the run changed nothing"
        out[command.name] = (command, template, steps, done["seconds"], old, new)
    return out


def fault_points(steps: list, actions: tuple[str, ...], everything: bool, seed: int) -> list:
    """(nth, action) pairs: all of them, or each action once at a step spread over the run."""
    if everything:
        return [(n, a) for n in range(1, len(steps) + 1) for a in actions]
    rng = random.Random(seed)
    picks = []
    for k, action in enumerate(actions):
        lo = 1 + k * len(steps) // len(actions)
        hi = max(lo, (k + 1) * len(steps) // len(actions))
        picks.append((rng.randint(lo, hi), action))
    return picks


def sweep(catalogue, server, tmp_path, everything: bool, random_kills: int):
    outcomes = []
    for index, (_name, (command, template, steps, seconds, old, new)) in enumerate(
        catalogue.items()
    ):
        rng = random.Random(index)
        cases = [
            ({"nth": n, "action": a}, None)
            for n, a in fault_points(steps, command.actions, everything, index)
        ]
        cases += [(None, rng.uniform(0.05, 1.1) * seconds) for _ in range(random_kills)]
        for k, (fault, kill_after) in enumerate(cases):
            case = tmp_path / f"{index}-{k}"
            outcomes.append(run_case(server, command, template, case, fault, old, new, kill_after))
    counts = Counter((o.command, o.fault.split("@")[0]) for o in outcomes)
    summary = {
        "faults": len(outcomes),
        "by_command": Counter(o.command for o in outcomes),
        "by_action": Counter(o.fault.split("@")[0] for o in outcomes),
        "after_fault": Counter(o.after_fault for o in outcomes),
        "failed": [f"{o.command} {o.fault}: {p}" for o in outcomes for p in o.problems],
        "cases": {f"{c} / {a}": n for (c, a), n in sorted(counts.items())},
    }
    if os.environ.get("SEQKV_FAULT_COUNTS"):
        Path(os.environ["SEQKV_FAULT_COUNTS"]).write_text(json.dumps(summary, indent=1))
    return summary


def test_every_writing_command_survives_a_spread_of_faults(catalogue, server, tmp_path):
    summary = sweep(catalogue, server, tmp_path, everything=False, random_kills=1)
    assert summary["failed"] == [], "\n".join(summary["failed"])
    assert summary["faults"] >= 4 * len(catalogue)


@pytest.mark.slow
def test_every_writing_command_survives_every_fault_at_every_step(catalogue, server, tmp_path):
    summary = sweep(catalogue, server, tmp_path, everything=True, random_kills=4)
    assert summary["failed"] == [], "\n".join(summary["failed"])
    assert summary["faults"] >= 200
