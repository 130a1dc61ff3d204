"""Small filesystem helpers shared by commands that write files.

The rules they enforce: refuse an output that is also an input, write through a temporary
sibling renamed into place (never a half-written file under the real name), give files the
permissions the user's umask asks for, and only ever delete what this run created.

One of each: one staging-name scheme (`staging_name`: `.{target}.{host}-{pid}-{random}{kind}`,
for files and folders alike), one cleaner (`clean_stale`, run whenever a name is staged in a
folder: what a killed writer left there goes once its process is gone), one publish
(`publish`/`atomic_path`), and one fault seam (`checkpoint`): every step of a write where the
OS can refuse or a signal can land is named there, so tests make it fail, signal or die.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import secrets
import shutil
import socket
from collections.abc import Callable, Iterable, Iterator
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
    with `create_parent`) or not writable. A symlink is checked where it points: the file
    it names is the one written (`write_target`)."""
    path = write_target(path)
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


# -- the fault seam ------------------------------------------------------------------------
# Each step of a write where the OS can refuse (a full disk, a quota, a read-only mount) or a
# signal or a kill can land passes `checkpoint(step, path)` first. Nothing listens in normal
# runs; tests (`injected`) make any step raise, signal or kill the process, without strace.
# The steps, in the order a write meets them:
#   stage      a staging name is taken (the file or folder is created next)
#   write      bytes go to a staged file (or to an archive past its committed end)
#   flush      buffered bytes go to the OS
#   close      a staged file is closed (a full disk can refuse its buffered tail here)
#   truncate   an archive drops an uncommitted tail
#   fsync      a file's data is made durable
#   commit     an archive's spare superblock slot is rewritten (its commit point)
#   chmod      a staged file gets the umask's mode
#   rename     a staged file replaces its target (`link`: an exclusive publish)
#   fsync-dir  the rename is made durable
STEPS = (
    "stage",
    "write",
    "flush",
    "close",
    "truncate",
    "fsync",
    "commit",
    "chmod",
    "rename",
    "link",
    "fsync-dir",
)
_listener: Callable[[str, Path], None] | None = None


def checkpoint(step: str, path: str | os.PathLike[str]) -> None:
    """The step `step` (one of STEPS) of a write to `path` is about to run."""
    if _listener is not None:
        _listener(step, Path(path))


@contextlib.contextmanager
def injected(listener: Callable[[str, Path], None]) -> Iterator[None]:
    """Call `listener(step, path)` at every checkpoint of this process while the block runs."""
    global _listener
    previous, _listener = _listener, listener
    try:
        yield
    finally:
        _listener = previous


# -- one staging-name scheme, one cleaner -------------------------------------------------
# Whatever a writer stages beside its target, file or folder, is named `.{target}.{tag}{kind}`
# with tag `{host}-{pid}-{random}` (`run_tag`): unique to one run, and it names the process,
# so the next writer in that folder tells a dead writer's leftovers from a live one's.
# A staging name of a staging name is named after the real target, so a file staged in
# steps (a new archive, verified, then linked into place) leaves names of one pattern only.
_STAGED = re.compile(
    r"\.(?P<target>.+)\.(?P<host>[0-9a-f]{8})-(?P<pid>[0-9]+)-[0-9A-Za-z_]+(?P<kind>\.[-.\w]*)?"
)


def staged_target(name: str) -> tuple[str, int] | None:
    """(the target's name, the writer's pid) of a staging name made on this host, else None.

    Names of seqkv 0.5 and earlier nested (`..x.skv.{tag}.staging.{tag}.tmp`): the outermost tag,
    the last, names the process that made the file, and is the one read."""
    found = _STAGED.fullmatch(name)
    if found is None or found["host"] != host_tag():
        return None
    target = found["target"]
    inner = _STAGED.fullmatch(target) if target.startswith(".") else None
    if inner is not None and inner["host"] == found["host"]:
        target = inner["target"]
    return target, int(found["pid"])


def write_target(path: str | os.PathLike[str]) -> Path:
    """The file a write to `path` replaces: `path`, or where a symlink there points (an
    in-place operation acts on the file the link names; replacing the link would split the
    two, and later writes through one would not show through the other)."""
    path = Path(path)
    real = Path(os.path.realpath(path))
    return path if real == Path(os.path.abspath(path)) else real  # no link: as given


def staging_name(target: Path, suffix: str = ".tmp") -> Path:
    """`.{name}.{run_tag}{suffix}` beside the file `target` names (`write_target`), after
    removing what dead writers staged in that folder (`clean_stale`): unique to this run,
    and a later run can tell it from a live writer's."""
    target = write_target(target)
    name = target.name
    parsed = staged_target(name)
    if parsed is not None and parsed[1] == os.getpid():
        name = parsed[0]
    try:  # the writer creates the staged file next: its refusal, as a writer would say it
        checkpoint("stage", target)
    except OSError as exc:
        raise PublishError(target, describe_os_error(exc)) from None
    clean_stale(target.parent)
    return target.with_name(f".{name}.{run_tag()}{suffix}")


def clean_stale(folder: Path) -> list[Path]:
    """Delete what writers on this host that no longer run staged in `folder` (files and
    folders named by `staging_name`); what live writers staged, and every name that is not
    a staging name of this host, is kept."""
    removed = []
    with contextlib.suppress(OSError), os.scandir(folder) as entries:
        for entry in entries:
            if not entry.name.startswith("."):
                continue
            parsed = staged_target(entry.name)
            if parsed is None or pid_alive(parsed[1]):
                continue
            path = Path(entry.path)
            discard_quietly(path)
            if not os.path.lexists(path):
                removed.append(path)
    return removed


def staging_dir(target: Path) -> Path:
    """A folder of this run beside `target` (a staging name, kind `.stage`), for writers
    that stage on their own inside it: safetensors writes `.tmpXXXXXX` beside the file it
    is given, which no cleaner could tell from anyone else's; inside this folder, it goes
    with the folder."""
    folder = staging_name(target, ".stage")
    folder.mkdir()
    return folder


def publish(staged: Path, target: Path, *, exclusive: bool = False) -> bool:
    """The one way seqkv puts a finished file under its real name.

    In order: fsync the staged file's data (a rename that reaches the disk before the data
    would publish an empty file after a power cut), give it the mode the umask asks for,
    rename it over `target` (or, `exclusive`, hard-link it only where `target` does not exist
    yet: False when another writer got there first), fsync the directory. A symlink at
    `target` stays: the file it names is replaced (`write_target`). The staged file is gone
    afterwards, whatever happened. Any OS failure is one `PublishError` line.
    """
    staged, shown, target = Path(staged), Path(target), write_target(target)
    try:
        if target.is_dir():
            raise PublishError(shown, "it is a directory; give a file name")
        checkpoint("fsync", staged)
        fd = os.open(staged, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        checkpoint("chmod", staged)
        os.chmod(staged, file_mode())
        if exclusive:
            checkpoint("link", target)
            try:
                os.link(staged, target)
            except FileExistsError:
                return False
            except OSError:  # no hard links here: exclusive up to the instant between the two
                if target.exists():
                    return False
                os.replace(staged, target)
        else:
            checkpoint("rename", target)
            os.replace(staged, target)
    except OSError as exc:
        raise PublishError(shown, describe_os_error(exc)) from None
    finally:
        discard_quietly(staged)
    fsync_dir(target.parent)
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
def atomic_path(path: Path, suffix: str = ".tmp", *, own_dir: bool = False) -> Iterator[Path]:
    """A staging name beside `path` to write to, published over `path` (`publish`) when the
    block succeeds and deleted when it fails: the real name never holds a half-written file.
    Leftovers of writers killed on this host are removed first (`staging_name`). `own_dir`:
    the name lies in a `staging_dir` of this run, for a library that stages on its own."""
    path = Path(path)
    if own_dir:
        folder = staging_dir(path)
        tmp = folder / path.name
    else:
        folder = tmp = staging_name(path, suffix)
    try:
        checkpoint("write", tmp)
        yield tmp
        publish(tmp, path)
    finally:
        discard_quietly(folder)


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
    """Delete a temporary file or folder of ours; a failure here must never hide the error
    that led to it (on a read-only mount even unlinking a missing file fails)."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
        return
    with contextlib.suppress(OSError):
        path.unlink(missing_ok=True)


def fsync_dir(folder: Path) -> None:
    """Make a rename in `folder` durable; platforms that cannot open a directory skip it,
    and a failure is not the write's (the file is in place already)."""
    try:
        checkpoint("fsync-dir", folder)
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
