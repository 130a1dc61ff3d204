"""The one publish (fsutil.publish / atomic_path): a writer killed with SIGKILL at any step
leaves the target whole (old or new, never part of either), and the next writer removes what
the dead one staged."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from seqkv_cli.errors import SeqkvError
from seqkv_cli.fsutil import PublishError, atomic_path, publish, staging_name

OLD, NEW = b"old contents\n" * 50, b"new contents, longer\n" * 400
# Each step is where the child kills itself: mid-write, at each call of the publish in turn
# (fsync of the data, chmod, the rename or link, after it, the directory's fsync).
STEPS = ["write", "fsync-file", "chmod", "rename", "after-rename", "fsync-dir"]

CHILD = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    from seqkv_cli import fsutil

    target, step, exclusive = Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
    new = sys.stdin.buffer.read()
    die = lambda: os.kill(os.getpid(), signal.SIGKILL)
    fsyncs = []
    real_fsync, real_chmod = os.fsync, os.chmod
    real_replace, real_link = os.replace, os.link

    def fsync(fd):
        fsyncs.append(fd)
        if (step, len(fsyncs)) in (("fsync-file", 1), ("fsync-dir", 2)):
            die()
        return real_fsync(fd)

    def chmod(*a, **k):
        if step == "chmod":
            die()
        return real_chmod(*a, **k)

    def rename(real):
        def call(*a, **k):
            if step == "rename":
                die()
            real(*a, **k)
            if step == "after-rename":
                die()
        return call

    os.fsync, os.chmod = fsync, chmod
    os.replace, os.link = rename(real_replace), rename(real_link)
    staged = fsutil.staging_name(target)
    with open(staged, "wb") as handle:
        handle.write(new[: len(new) // 2])
        handle.flush()
        if step == "write":
            die()
        handle.write(new[len(new) // 2 :])
    fsutil.publish(staged, target, exclusive=exclusive)
    """
)


def _kill_at(target: Path, step: str, exclusive: bool) -> int:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(target), step, "1" if exclusive else "0"],
        input=NEW,
        capture_output=True,
        timeout=120,
    )
    return done.returncode


@pytest.mark.parametrize("exclusive", [False, True], ids=["replace", "exclusive"])
@pytest.mark.parametrize("step", STEPS)
def test_a_writer_killed_at_any_step_leaves_the_target_whole(tmp_path, step, exclusive):
    target = tmp_path / "out.bin"
    if not exclusive:
        target.write_bytes(OLD)
    code = _kill_at(target, step, exclusive)
    assert code == -9, f"the child was not killed at {step} (exit {code})"
    before = b"" if exclusive else OLD
    got = target.read_bytes() if target.exists() else b""
    assert got in (before, NEW), f"{step}: the target holds {len(got)} bytes of neither"
    assert got == (NEW if step in ("after-rename", "fsync-dir") else before)
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith(".out.bin.")]
    if step in ("after-rename", "fsync-dir") and not exclusive:
        assert leftovers == []  # renamed: nothing staged is left
    # the next writer on this host removes what the dead one staged, and publishes
    with atomic_path(target) as tmp:
        tmp.write_bytes(b"third")
    assert target.read_bytes() == b"third"
    assert [p for p in tmp_path.iterdir() if p != target] == []


def test_publish_refuses_a_directory_and_cleans_up(tmp_path):
    folder = tmp_path / "d"
    folder.mkdir()
    staged = staging_name(folder)
    staged.write_bytes(b"x")
    with pytest.raises(PublishError, match="is a directory; give a file name"):
        publish(staged, folder)
    assert not staged.exists() and list(folder.iterdir()) == []


def test_exclusive_publish_never_replaces(tmp_path):
    target = tmp_path / "t"
    target.write_bytes(OLD)
    staged = staging_name(target)
    staged.write_bytes(NEW)
    assert publish(staged, target, exclusive=True) is False
    assert target.read_bytes() == OLD and not staged.exists()


def test_published_files_take_the_umask_mode(tmp_path):
    old = os.umask(0o027)
    try:
        with atomic_path(tmp_path / "m") as tmp:
            tmp.write_bytes(b"x")
    finally:
        os.umask(old)
    assert (tmp_path / "m").stat().st_mode & 0o777 == 0o640


def test_a_failing_block_publishes_nothing(tmp_path):
    target = tmp_path / "t"
    target.write_bytes(OLD)
    with pytest.raises(SeqkvError), atomic_path(target) as tmp:
        tmp.write_bytes(b"half")
        raise SeqkvError("stopped")
    assert target.read_bytes() == OLD and list(tmp_path.iterdir()) == [target]


# -- one staging-name scheme, one cleaner, the fault seam (issue 37) -----------------------


def _dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    return int(done.stdout)


def test_a_staging_name_of_a_staging_name_is_named_after_the_real_target(tmp_path):
    from seqkv_cli.fsutil import run_tag, staged_target

    first = staging_name(tmp_path / "m.skv", ".new.skv")
    second = staging_name(first, ".staging")
    third = staging_name(second)
    for name in (first, second, third):
        assert name.parent == tmp_path and name.name.startswith(".m.skv.")
        assert staged_target(name.name) == ("m.skv", os.getpid())
    assert third.name.endswith(".tmp") and second.name.endswith(".staging")
    # a user's file that merely looks staged (another pid) keeps its own name as the target
    look_alike = tmp_path / f".m.skv.{run_tag().replace(str(os.getpid()), '1')}.tmp"
    assert staging_name(look_alike).name.startswith(f".{look_alike.name}.")


def test_the_cleaner_removes_what_dead_writers_staged_files_and_folders(tmp_path):
    from seqkv_cli.fsutil import clean_stale, host_tag

    dead, host = _dead_pid(), host_tag()
    gone = [
        tmp_path / f".x.skv.{host}-{dead}-0badc0de.tmp",
        tmp_path / f".a.safetensors.{host}-{dead}-0badc0de.stage",  # a folder, with content
        tmp_path / f"..x.skv.{host}-1-0badc0de.staging.{host}-{dead}-feedf00d.tmp",  # 0.5 names
        tmp_path / f".x.skv.compact.{host}-{dead}-ab_x9z01",  # 0.5's compact scratch folder
    ]
    kept = [
        tmp_path / f".x.skv.{host}-{os.getpid()}-0badc0de.tmp",  # this process: live
        tmp_path / f".x.skv.00000000-{dead}-0badc0de.tmp",  # another host: cannot tell
        tmp_path / ".tmpAbC123",  # not a staging name
        tmp_path / f"x.skv.{host}-{dead}-0badc0de.tmp",  # not hidden: not ours
    ]
    for path in gone + kept:
        if path.name.endswith((".stage", "ab_x9z01")):
            path.mkdir()
            (path / ".tmpXYZ").write_bytes(b"half a capture")
        else:
            path.write_bytes(b"left behind")
    assert sorted(clean_stale(tmp_path)) == sorted(gone)
    assert sorted(p for p in tmp_path.iterdir()) == sorted(kept)


def test_a_symlink_target_is_written_through(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (real / "a.bin").write_bytes(OLD)
    link = tmp_path / "link.bin"
    link.symlink_to(real / "a.bin")
    with atomic_path(link) as tmp:
        assert tmp.parent == real
        tmp.write_bytes(NEW)
    assert link.is_symlink() and (real / "a.bin").read_bytes() == NEW
    assert sorted(p.name for p in real.iterdir()) == ["a.bin"]


@pytest.mark.parametrize("own_dir", [False, True])
def test_every_step_of_a_publish_passes_the_seam_and_an_error_there_cleans_up(tmp_path, own_dir):
    import errno

    from seqkv_cli.fsutil import injected

    target = tmp_path / "t.bin"
    target.write_bytes(OLD)
    met = []
    with injected(lambda step, path: met.append(step)), atomic_path(target, own_dir=own_dir) as t:
        t.write_bytes(NEW)
    assert met == ["stage", "write", "fsync", "chmod", "rename", "fsync-dir"]
    for step in met[:-1]:

        def refuse(at, path, step=step):
            if at == step:
                raise OSError(errno.ENOSPC, "No space left on device")

        target.write_bytes(OLD)
        with (
            pytest.raises((OSError, PublishError), match="No space left"),
            injected(refuse),
            atomic_path(target, own_dir=own_dir) as tmp,
        ):
            tmp.write_bytes(NEW)
        assert target.read_bytes() == OLD, step
        assert list(tmp_path.iterdir()) == [target], step
