"""Tables printed to a pipe (CI logs, files) keep every id and number whole."""

from __future__ import annotations

import os
import subprocess
import sys

import seqkv_cli as seqkv

LONG_ID = "agent-transcript-" + "0123456789" * 9  # 107 characters: wider than 80 columns


def _cli(*args, env):
    code = "from seqkv_cli.cli import main; main()"
    return subprocess.run(
        [sys.executable, "-c", code, *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


def test_archive_list_through_a_pipe_prints_whole_ids(tmp_path, tiny_lm):
    with seqkv.open_archive(tmp_path / "a.skv", model=tiny_lm) as arc:
        arc.add(LONG_ID, list(range(3, 40)))
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    piped = _cli("archive", "list", tmp_path / "a.skv", env=env)
    assert piped.returncode == 0, piped.stderr
    assert LONG_ID in piped.stdout and "…" not in piped.stdout
    narrow = _cli("archive", "list", tmp_path / "a.skv", env={**env, "COLUMNS": "60"})
    assert narrow.returncode == 0 and LONG_ID not in narrow.stdout  # COLUMNS still rules
