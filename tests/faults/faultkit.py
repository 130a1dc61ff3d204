"""The fault sweep's kit: the fork server's client, the writing commands it attacks (how to
set each up, run it, and read what it wrote), and the checks every injected fault must pass.

A case: copy the command's prepared folder, run the command with one fault (a SIGKILL,
SIGTERM or SIGINT at the N-th checkpoint of the fault seam, an ENOSPC/EDQUOT/EROFS there
that stays, or a SIGKILL at a random moment), check what it left, run the same command again
with no fault, check again. The checks: no traceback; the exit status the fault calls for;
a handled fault gives one last line ("error: ...", "terminated", "interrupted") and leaves no
staged file; what the outputs hold is the old content or the new, never a mix, and after the
rerun the new (no lost or stale session); after the rerun nothing staged is left anywhere in
the case folder.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
SIGNAL_STATUS = {"kill": -9, "term": 143, "int": 130}
ERROR_TEXT = {
    "enospc": "No space left on device",
    "edquot": "Disk quota exceeded",
    "erofs": "Read-only file system",
}


class ForkServer:
    """The client of forkserver.py: one request at a time."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "forkserver.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**_env(), "PYTHONPATH": str(HERE.parent.parent)},
        )

    def run(self, request: dict) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the fork server died (exit {self.proc.poll()})")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def _env() -> dict:
    import os

    return {**os.environ, "COLUMNS": "200", "TRANSFORMERS_VERBOSITY": "error"}


# -- the library API, as a child of the fork server runs it ---------------------------------


def run_api(name: str, args: list) -> int:
    """Run API[name](*args) the way a program using seqkv would: a SeqkvError is its one
    line (status 2), Ctrl-C status 130; anything else escapes (a traceback: a finding)."""
    from seqkv_cli.errors import SeqkvError

    try:
        API[name](*args)
    except SeqkvError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


def api_add(archive: str, model_dir: str, session_id: str, ids: list[int]) -> None:
    import seqkv_cli

    with seqkv_cli.open_archive(archive, model=model_dir) as arc:
        arc.add(session_id, ids)


API: dict[str, Callable] = {"add": api_add}


# -- what a command wrote, as a value that compares ---------------------------------------


def digest(*tensors) -> str:
    h = hashlib.blake2b(digest_size=8)
    for t in tensors:
        h.update(t.contiguous().view(-1).view(dtype=__import__("torch").uint8).numpy().tobytes())
    return h.hexdigest()


def archive_state(path: Path, lm=None, kv: bool = True):
    """Every session of an archive: id -> (tokens, digest of its K/V); None: no file."""
    from seqkv_cli.archive import Archive

    if not path.exists():
        return None
    with Archive(path, model=lm) as arc:
        out = {}
        for entry, cap in arc.restore_many(arc.sessions):
            if isinstance(cap, Exception):
                raise cap
            out[entry["id"]] = (
                tuple(cap.tokens.tolist()),
                digest(*cap.keys, *cap.values) if kv else "",
            )
        return out


def captures_state(folder: Path):
    """The capture files of a folder: name -> (session id, tokens, digest of its K/V)."""
    from seqkv_cli.kvcapture.capture_file import load_capture

    if not folder.exists():
        return None
    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        cap = load_capture(path)
        out[path.name] = (cap.session_id, tuple(cap.tokens.tolist()), digest(*cap.keys))
    return out


def sharded_state(folder: Path, lm):
    """A sharded archive as one: id -> tokens, each decoded from its shard; "refused: ..."
    when its manifest does not vouch for its shards (stale or incomplete: never silent)."""
    from seqkv_cli.archive import manifest_file, read_manifest
    from seqkv_cli.errors import SeqkvError

    if not folder.exists() or manifest_file(folder) is None:
        return None
    try:
        man = read_manifest(folder)
    except SeqkvError as exc:
        return f"refused: {str(exc)[:60]}"
    out = {}
    for shard in man.shards():
        for sid, (tokens, _) in archive_state(shard, lm, kv=False).items():
            out[sid] = tokens
    return out


def stray(folder: Path) -> list[str]:
    """What a writer staged and left: hidden entries anywhere in the folder."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob(".*"))


# -- the commands ----------------------------------------------------------------------------


@dataclass
class Command:
    """One writing command: `prepare(folder)` makes its inputs and earlier outputs,
    `request(folder)` is the fork server request (cwd and within are added), `state(folder)`
    reads what its outputs hold."""

    name: str
    prepare: Callable[[Path], None]
    request: Callable[[Path], dict]
    state: Callable[[Path], object]
    actions: tuple[str, ...] = ("kill", "term", "int", "enospc", "edquot", "erofs")
    api: bool = False
    # An append is not idempotent: when the faulted run committed before it failed (a kill
    # after the commit point, a failed fsync after it), the rerun is refused with this
    # line, and what the file holds is already the new content.
    done_already: str | None = None


@dataclass
class Outcome:
    command: str
    fault: str
    problems: list[str] = field(default_factory=list)
    after_fault: str = ""  # "old", "new" or "refused"


def _read(command: Command, folder: Path, problems: list[str]):
    try:
        return command.state(folder)
    except Exception as exc:  # an output that cannot be read back: the worst finding
        problems.append(f"an output cannot be read: {type(exc).__name__}: {str(exc)[:120]}")
        return None


def classify(state, old, new) -> str:
    """ "old", "new", "partly new" (each output file old or new: a command of several files
    killed between two publishes), "refused" (a sharded archive whose manifest no longer
    vouches for its shards: refused when read, never silently stale), or "mixed"."""
    if state == new:
        return "new"
    if state == old:
        return "old"
    if state is None:
        return "mixed"
    keys = set(old) | set(new) | set(state)
    values = {k: state.get(k) for k in keys}
    if any(isinstance(v, str) and v.startswith("refused") for v in values.values()):
        return "refused"
    if all(values[k] in (old.get(k), new.get(k)) for k in keys):
        return "partly new"
    return "mixed"


def run_case(server: ForkServer, command: Command, template: Path, folder: Path, fault, old,
             new, kill_after=None) -> Outcome:  # fmt: skip
    """One injected fault and the rerun; what went wrong, if anything."""
    shutil.copytree(template, folder, symlinks=True)
    label = f"{fault['action']}@{fault['nth']}" if fault else f"kill@{kill_after:.3f}s"
    outcome = Outcome(command.name, label)
    problems = outcome.problems
    before = set(stray(folder))
    request = dict(command.request(folder), cwd=str(folder), within=str(folder), timeout=300)
    request.update(fault=fault, kill_after=kill_after)
    done = server.run(request)
    action = fault["action"] if fault else "kill"
    if done["timed_out"]:
        problems.append("timed out")
    if "Traceback" in done["stderr"]:
        problems.append("traceback: " + done["stderr"].strip().splitlines()[-1][:120])
    handled = done["rc"] not in (-9, -15)
    if fault is None:
        expected = {-9, 0}  # the kill may come after the command finished
    elif action in SIGNAL_STATUS:
        expected = {SIGNAL_STATUS[action]}
        if command.api and action == "term":
            expected = {-15}  # a library leaves signals to the program that uses it
    else:
        expected = {2, 0}  # 0: a step whose failure is harmless (the directory's fsync)
    if done["rc"] not in expected:
        problems.append(f"exit {done['rc']}, expected {sorted(expected)}")
    if handled and done["rc"] != 0:
        lines = [ln for ln in done["stderr"].splitlines() if ln.strip()]
        last = lines[-1] if lines else ""
        verdicts = [
            ln for ln in lines if ln.startswith("error:") or ln in ("terminated", "interrupted")
        ]
        if len(verdicts) != 1 or last != verdicts[0]:
            problems.append(f"not one last line: {lines[-3:]}")
        if action in ERROR_TEXT and ERROR_TEXT[action] not in last:
            problems.append(f"the error line does not say why: {last[:120]}")
        left = sorted(set(stray(folder)) - before)
        if left:
            problems.append(f"left staged: {left[:3]}")
    state = _read(command, folder, problems)
    outcome.after_fault = classify(state, old, new)
    if outcome.after_fault == "mixed":
        problems.append(f"after the fault an output holds neither old nor new: {str(state)[:160]}")
    again = server.run(dict(request, fault=None, kill_after=None))
    committed = command.done_already and command.done_already in again["stderr"]
    if again["rc"] != 0 and not (committed and outcome.after_fault == "new"):
        problems.append(f"the rerun failed: {again['rc']} {again['stderr'].strip()[-200:]}")
    if _read(command, folder, problems) != new:
        problems.append("after the rerun the outputs do not hold the new content (lost or stale)")
    left = sorted(set(stray(folder)) - before)
    if left:
        problems.append(f"left after the rerun: {left[:3]}")
    shutil.rmtree(folder, ignore_errors=True)
    return outcome
