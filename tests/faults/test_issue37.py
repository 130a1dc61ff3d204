"""Issue 37, the six failures an outside fault tester found, each as it was reported.

These tests patch OS calls in a child process (oschild.py) or use a real full filesystem,
not seqkv's own fault seam, so that they run unchanged against the code before the fixes
(where each of them failed). The broad sweep over every writing command is in
test_fault_sweep.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cli_run import assert_error, invoke
from seqkv_cli.kvcapture.capture_file import load_capture
from test_data_safety import write

CHILD = Path(__file__).with_name("oschild.py")


def child(plan: dict, *args, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `seqkv ARGS` (or `--api-add ...`) in a child whose OS calls follow `plan`."""
    return subprocess.run(
        [sys.executable, str(CHILD), json.dumps(plan), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "COLUMNS": "200"},
    )


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def stray(folder: Path) -> list[str]:
    """Every hidden entry of `folder` and below: what a writer staged and left."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob(".*"))


def one_error_line(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip()]


# -- 1. a rerun after an edit never keeps the old shard -----------------------------------


def test_a_rerun_after_an_edit_of_the_same_length_rewrites_the_shard(tmp_path, tiny_lm):
    from seqkv_cli.kvcapture.rows import Row
    from seqkv_cli.scale.common import tokenize_row

    # the edit lies past the first 64 tokens (the prefix key), as a user's message lies past
    # a chat's system prompt: the shard plan, its names and its counts stay the same
    head = "A long opening paragraph that every session of this dataset starts with, "
    text = [f"Session {i}. {head}then talks about the weather today." for i in range(4)]
    rows = [{"id": f"s{i}", "text": t} for i, t in enumerate(text)]
    data = write_jsonl(tmp_path / "sessions.jsonl", rows)
    out = tmp_path / "shards"
    base = ("--model", tiny_lm.folder, "--shard-sessions", "2", "--no-verify")
    first = invoke("compress", data, "-o", out, *base)
    assert first.exit_code == 0, first.output
    rows[2]["text"] = rows[2]["text"].replace("weather", "WEATHER")  # same token count here
    write_jsonl(data, rows)
    new = tokenize_row(tiny_lm, Row("s2", "x", text=rows[2]["text"]))
    old = tokenize_row(tiny_lm, Row("s2", "x", text=text[2]))
    assert len(new) == len(old) and new != old
    again = invoke("compress", data, "-o", out, *base)
    assert again.exit_code == 0, again.output
    assert "(1 already complete)" in again.stdout.replace("\n", " ")  # s2's shard: rewritten
    got = invoke("archive", "extract", out, "s2", "-o", tmp_path / "s2.safetensors", *base[:2])
    assert got.exit_code == 0, got.output
    assert load_capture(tmp_path / "s2.safetensors").tokens.tolist() == new


# -- 2. SIGTERM is handled like SIGINT -----------------------------------------------------


def test_sigterm_at_the_publish_of_compress_onto_a_file_cleans_up(tmp_path):
    a, b = write(tmp_path, "a", "a"), write(tmp_path, "b", "b", n=9)
    out = tmp_path / "arch"
    out.mkdir()
    skv = out / "x.skv"
    assert invoke("compress", a, "-o", skv, "--codec", "raw").exit_code == 0
    before = skv.read_bytes()
    done = child({"call": "replace", "nth": 1, "action": "term"}, "compress", a, b, "-o", skv,
                 "--codec", "raw")  # fmt: skip
    assert done.returncode == 143, (done.returncode, done.stderr)
    assert one_error_line(done.stderr) == ["terminated"], done.stderr
    assert skv.read_bytes() == before
    assert stray(out) == []


def test_sigterm_during_decompress_leaves_no_partial_files(tmp_path):
    caps = [write(tmp_path, "a", "a"), write(tmp_path, "b", "b", n=9)]
    skv = tmp_path / "x.skv"
    assert invoke("compress", *caps, "-o", skv, "--codec", "raw").exit_code == 0
    out = tmp_path / "out"
    out.mkdir()
    # the first rename, then the first under a real name (once every capture is staged)
    for plan in ({"nth": 1}, {"nth": 1, "visible": True}):
        plan.update(call="replace", action="term", within=str(out))
        done = child(plan, "decompress", skv, "-o", out)
        assert done.returncode == 143, (plan, done.returncode, done.stderr)
        assert one_error_line(done.stderr) == ["terminated"], done.stderr
        assert stray(out) == [], plan


# -- 3. what a killed writer staged, the next one removes -----------------------------------


def test_a_decompress_killed_after_staging_leaves_nothing_once_it_ran_again(tmp_path):
    caps = [write(tmp_path, "a", "a"), write(tmp_path, "b", "b", n=9)]
    skv = tmp_path / "x.skv"
    assert invoke("compress", *caps, "-o", skv, "--codec", "raw").exit_code == 0
    out = tmp_path / "out"
    plan = {"call": "replace", "nth": 1, "action": "kill", "within": str(out), "visible": True}
    done = child(plan, "decompress", skv, "-o", out)
    assert done.returncode == -9, done.stderr
    assert stray(out), "the kill left nothing staged: it came too early to test anything"
    again = invoke("decompress", skv, "-o", out)
    assert again.exit_code == 0, again.output
    assert sorted(p.name for p in out.iterdir()) == ["a.safetensors", "b.safetensors"]


def test_a_capture_killed_inside_the_safetensors_write_leaves_nothing_once_rerun(tmp_path):
    # ~19 MB of K/V (a write that takes a while); token ids below 2^16 (see the report)
    big = write(tmp_path, "big", "big", tokens=[1 + i % 1000 for i in range(150_000)])
    skv = tmp_path / "x.skv"
    assert invoke("compress", big, "-o", skv, "--codec", "raw").exit_code == 0
    out = tmp_path / "out"
    out.mkdir()
    done = child({"watch": str(out)}, "decompress", skv, "-o", out)
    assert done.returncode == -9, done.stderr
    assert any(".tmp" in name for name in stray(out)), stray(out)
    again = invoke("decompress", skv, "-o", out)
    assert again.exit_code == 0, again.output
    assert stray(out) == [] and [p.name for p in out.iterdir()] == ["big.safetensors"]


# -- 4. an in-place operation acts on the file a symlink names ------------------------------


def test_compact_through_a_symlink_compacts_the_file_it_names(tmp_path):
    caps = [write(tmp_path, s, s, n=10 + i) for i, s in enumerate("abc")]
    real = tmp_path / "real"
    real.mkdir()
    arch = real / "arch.skv"
    assert invoke("compress", caps[0], "-o", arch, "--codec", "raw").exit_code == 0
    assert invoke("archive", "add", arch, caps[1]).exit_code == 0
    link = tmp_path / "link.skv"
    link.symlink_to(arch)
    done = invoke("archive", "compact", link)
    assert done.exit_code == 0, done.output
    assert link.is_symlink() and link.resolve() == arch.resolve()
    assert invoke("archive", "add", arch, caps[2]).exit_code == 0
    listed = invoke("archive", "list", link)
    assert listed.exit_code == 0 and "3 session(s)" in listed.stdout, listed.output
    assert stray(real) == [] and stray(tmp_path) == []


# -- 5. the API's first add, killed at its first fsync --------------------------------------


def test_the_apis_first_add_killed_at_its_first_fsync_leaves_nothing_after_a_rerun(
    tmp_path, tiny_model_dir
):
    folder = tmp_path / "mem"
    folder.mkdir()
    archive, ids = folder / "m.skv", json.dumps(list(range(5, 25)))
    plan = {"call": "fsync", "nth": 1, "action": "kill", "within": str(folder)}
    done = child(plan, "--api-add", archive, tiny_model_dir, "s", ids)
    assert done.returncode == -9, done.stderr
    again = child({"call": "fsync", "nth": 10**9, "action": "kill"}, "--api-add", archive,
                  tiny_model_dir, "s", ids)  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert [p.name for p in folder.iterdir()] == ["m.skv"]


# -- 6. a full disk is one line, and leaves what was there ----------------------------------


@pytest.fixture
def tiny_disk(tmp_path):
    """A 3 MB tmpfs (root and mount needed; the injected ENOSPC of the sweep runs anywhere)."""
    folder = tmp_path / "disk"
    folder.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(folder)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()[:80]}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def fill(disk: Path) -> None:
    """Take every free block of `disk` with a file named `filler`."""
    with open(disk / "filler", "wb", buffering=0) as filler:
        try:
            while True:
                filler.write(b"\0" * 4096)
        except OSError:
            pass


@pytest.mark.parametrize("how", ["full", "fills"])
def test_compress_onto_an_archive_on_a_full_disk_is_one_line(tmp_path, tiny_disk, how):
    """`full`: the disk is full before the write (the few KB stay in a buffer until the
    flush fails, then the abort's close fails again); `fills`: the write fills it."""
    small, _ = write(tmp_path, "a", "a"), write(tmp_path, "b", "b", n=9)
    big = write(tmp_path, "big", "big", n=40_000)
    skv = tiny_disk / "x.skv"
    assert invoke("compress", small, "-o", skv, "--codec", "raw").exit_code == 0
    before = skv.read_bytes()
    if how == "full":
        fill(tiny_disk)
    done = invoke("compress", small, big if how == "fills" else small.parent / "b.safetensors",
                  "-o", skv, "--codec", "raw")  # fmt: skip
    assert_error(done, "No space left on device")
    assert skv.read_bytes() == before
    assert sorted(p.name for p in tiny_disk.iterdir()) == sorted(
        ["x.skv", "filler"][: 1 + (how == "full")]
    )


def test_dataset_compress_on_a_full_disk_is_one_line_and_leaves_no_folder(
    tmp_path, tiny_disk, tiny_model_dir
):
    rows = [{"id": f"s{i}", "token_ids": list(range(3, 40 + i))} for i in range(3)]
    data = write_jsonl(tmp_path / "s.jsonl", rows)
    fill(tiny_disk)
    out = tiny_disk / "shards"
    done = invoke("compress", data, "-o", out, "--model", tiny_model_dir, "--no-verify")
    assert_error(done, "No space left on device")
    assert not out.exists()
    assert [p.name for p in tiny_disk.iterdir()] == ["filler"]
