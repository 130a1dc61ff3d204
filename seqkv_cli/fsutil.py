"""Small filesystem helpers shared by commands that write files.

The rules they enforce: refuse an output that is also an input, write through a temporary
sibling renamed into place (never a half-written file under the real name), give files the
permissions the user's umask asks for, and only ever delete what this run created.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import shutil
import socket
from collections.abc import Iterable, Iterator
from pathlib import Path

from seqkv_cli.errors import SeqkvError


def ensure_writable_dir(folder: Path) -> None:
    """Create `folder` if needed and refuse early, in one line, if nothing can be written there."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SeqkvError(f"cannot create output directory {folder}: {exc.strerror}") from None
    if not os.access(folder, os.W_OK):
        raise SeqkvError(f"output directory {folder} is not writable")


def make_output_dir(folder: Path) -> list[Path]:
    """Like `ensure_writable_dir`, but return the directories this call created (outermost
    first), so that a run that fails can remove exactly those and nothing else."""
    folder = Path(folder)
    created = []
    probe = folder.absolute()
    while not probe.exists() and probe != probe.parent:
        created.append(probe)
        probe = probe.parent
    ensure_writable_dir(folder)
    return created[::-1]


def remove_created_dirs(created: list[Path]) -> None:
    """Remove directories `make_output_dir` created, innermost first, if they are empty."""
    for folder in reversed(created):
        with contextlib.suppress(OSError):
            folder.rmdir()


def check_output_file(path: Path, option: str = "-o", *, create_parent: bool = False) -> None:
    """Refuse, before any work, an output file that cannot be written: a directory there
    (seqkv never guesses a name inside it), or a folder that is missing (created instead
    with `create_parent`) or not writable."""
    path = Path(path)
    if path.is_dir():
        raise SeqkvError(f"{option} {path} is a directory; give a file name")
    folder = path.parent if str(path.parent) else Path(".")
    if create_parent:
        ensure_writable_dir(folder)
    elif not folder.is_dir():
        raise SeqkvError(f"cannot write {path}: the directory {folder} does not exist")
    elif not os.access(folder, os.W_OK):
        raise SeqkvError(f"cannot write {path}: the directory {folder} is not writable")


def same_file(a: Path, b: Path) -> bool:
    """True when `a` and `b` name one file (symlinks, `..` and hard links resolved)."""
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet): compare the resolved names
        return Path(a).resolve() == Path(b).resolve()


def refuse_output_in_inputs(out: Path, inputs: Iterable[Path], option: str = "-o") -> None:
    """Writing `out` would destroy an input it is reading: refuse before any work."""
    for path in inputs:
        if same_file(out, path):
            raise SeqkvError(
                f"{option} {out} is also an input ({path}); writing it would destroy the "
                "input: choose another output name"
            )


def file_mode() -> int:
    """0o666 minus the umask: what `open()` would give a new file (0644 under umask 022).

    tempfile.mkstemp creates files 0600; files seqkv publishes should not stay private.
    The umask is read by setting a strict one for an instant, so a thread creating a file
    meanwhile gets a file that is more private, never less.
    """
    mask = os.umask(0o077)
    os.umask(mask)
    return 0o666 & ~mask


class PublishError(SeqkvError):
    """The OS refused to put a finished file in place: `reason` says why, in a short phrase."""

    def __init__(self, target: Path, reason: str) -> None:
        super().__init__(f"cannot write {target}: {reason}")
        self.target, self.reason = Path(target), reason


def staging_name(target: Path, suffix: str = ".tmp") -> Path:
    """`.{name}.{run_tag}{suffix}` beside `target`: unique to this run, and a later run can
    tell it from a live writer's (`clean_stale_temporaries`)."""
    target = Path(target)
    return target.with_name(f".{target.name}.{run_tag()}{suffix}")


def publish(staged: Path, target: Path, *, exclusive: bool = False) -> bool:
    """The one way seqkv puts a finished file under its real name.

    In order: fsync the staged file's data (a rename that reaches the disk before the data
    would publish an empty file after a power cut), give it the mode the umask asks for,
    rename it over `target` (or, `exclusive`, hard-link it only where `target` does not exist
    yet: False when another writer got there first), fsync the directory. The staged file is
    gone afterwards, whatever happened. Any OS failure is one `PublishError` line.
    """
    staged, target = Path(staged), Path(target)
    try:
        if target.is_dir():
            raise PublishError(target, "it is a directory; give a file name")
        fd = os.open(staged, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.chmod(staged, file_mode())
        if exclusive:
            try:
                os.link(staged, target)
            except FileExistsError:
                return False
            except OSError:  # no hard links here: exclusive up to the instant between the two
                if target.exists():
                    return False
                os.replace(staged, target)
        else:
            os.replace(staged, target)
    except OSError as exc:
        raise PublishError(target, describe_os_error(exc)) from None
    finally:
        discard_quietly(staged)
    fsync_dir(target.absolute().parent)
    return True


def publish_directory(staging: Path, target: Path) -> None:
    """A finished directory under its real name (a converted model). A folder already there
    is an unfinished copy: it is renamed aside first (a rename cannot replace a non-empty
    folder), put back if the swap fails, and deleted once it succeeded."""
    staging, target = Path(staging), Path(target)
    if not target.exists():
        os.rename(staging, target)
    else:
        aside = staging.with_name(staging.name + ".old")
        os.rename(target, aside)
        try:
            os.rename(staging, target)
        except BaseException:
            os.rename(aside, target)
            raise
        shutil.rmtree(aside, ignore_errors=True)
    fsync_dir(target.absolute().parent)


@contextlib.contextmanager
def atomic_path(path: Path, suffix: str = ".tmp") -> Iterator[Path]:
    """A staging name beside `path` to write to, published over `path` (`publish`) when the
    block succeeds and deleted when it fails: the real name never holds a half-written file.
    Leftovers of writers killed on this host are removed first."""
    path = Path(path)
    clean_stale_temporaries(path, (suffix,))
    tmp = staging_name(path, suffix)
    try:
        yield tmp
        publish(tmp, path)
    finally:
        discard_quietly(tmp)


def describe_os_error(error: OSError) -> str:
    """Turn an OSError into a short phrase with the likely fix, for one-line messages."""
    if isinstance(error, FileNotFoundError):
        return "the directory does not exist; create it first"
    if isinstance(error, NotADirectoryError):
        return "a path component is not a directory"
    if isinstance(error, PermissionError):
        return "permission denied; choose a writable location"
    if isinstance(error, IsADirectoryError):
        return "the path is a directory; give a file name"
    return error.strerror or str(error)


def discard_quietly(path: Path) -> None:
    """Delete a temporary file of ours; a failure here must never hide the error that led
    to it (on a read-only mount even unlinking a missing file fails)."""
    with contextlib.suppress(OSError):
        Path(path).unlink(missing_ok=True)


def fsync_dir(folder: Path) -> None:
    """Make a rename in `folder` durable; platforms that cannot open a directory skip it."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# Temporary files are tagged `{host}-{pid}-{random}`: unique to one run, and a later run on
# the same host can tell the leftovers of a writer killed with SIGKILL from a live one's.
def host_tag() -> str:
    """Short and file-name safe; PIDs only mean something on the host that made them."""
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def run_tag() -> str:
    """`{host}-{pid}-{random}`: this run's part of a temporary file's name."""
    return f"{host_tag()}-{os.getpid()}-{secrets.token_hex(4)}"


def pid_alive(pid: int) -> bool:
    if pid == os.getpid() or os.name == "nt":  # on Windows os.kill(pid, 0) is a Ctrl-C
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists but not ours (EPERM), or the platform cannot tell: keep it
        return True
    return True


def clean_stale_temporaries(out: Path, suffixes: tuple[str, ...]) -> list[Path]:
    """Delete `.{out}.{run_tag}...{suffix}` files (and `..` temporaries of those) left by
    writers on this host that no longer run; live writers' files are kept."""
    removed = []
    folder, prefix = Path(out).absolute().parent, f".{Path(out).name}.{host_tag()}-"
    with contextlib.suppress(OSError):
        for entry in folder.iterdir():
            name = entry.name.removeprefix(".") if entry.name.startswith("..") else entry.name
            if not (name.startswith(prefix) and name.endswith(suffixes)):
                continue
            pid = name[len(prefix) :].split("-", 1)[0]
            if pid.isdigit() and not pid_alive(int(pid)):
                with contextlib.suppress(OSError):
                    entry.unlink()
                    removed.append(entry)
    return removed
