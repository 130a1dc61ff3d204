"""A fork server for the fault sweep: imports seqkv, torch and transformers once, then runs
each request in a forked child with one fault armed through seqkv's fault seam
(`fsutil.injected`), so that hundreds of real kills and signals take seconds, not minutes.

Protocol: one JSON request a line on stdin, one JSON answer a line on stdout.

    request  {"cwd": DIR, "argv": [...]} (the CLI) or {"cwd": DIR, "api": NAME, "args": [...]}
             (a function of faultkit.API), with
             "fault": {"nth": N, "action": ..., "within": DIR} or null,
             "trace": FILE or null (write the checkpoints met under "within" there),
             "kill_after": seconds or null (SIGKILL from outside, at a random moment),
             "timeout": seconds
    answer   {"rc": exit status (-N: killed by signal N), "stdout": ..., "stderr": ...,
              "seconds": ..., "timed_out": bool}

Actions: "kill" (SIGKILL), "term" (SIGTERM), "int" (SIGINT), and "enospc", "edquot",
"erofs": an OSError at that step that stays (a full disk refuses every later write, flush,
close and fsync; a read-only one every step).

The server itself never runs torch work (forking after OpenMP threads started could hang
the child) and keeps torch at one thread.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

torch.set_num_threads(1)

import pyarrow.parquet  # noqa: E402,F401  (imported once here, not in every child)
import safetensors.torch  # noqa: E402,F401
import transformers  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402,F401
from transformers.models.llama import modeling_llama  # noqa: E402,F401

from seqkv_cli import fsutil  # noqa: E402
from seqkv_cli.cli import app  # noqa: E402

transformers.logging.set_verbosity_error()
sys.path.insert(0, str(Path(__file__).parent))
import faultkit  # noqa: E402

SIGNALS = {"kill": signal.SIGKILL, "term": signal.SIGTERM, "int": signal.SIGINT}
ERRNOS = {"enospc": errno.ENOSPC, "edquot": errno.EDQUOT, "erofs": errno.EROFS}
# The steps a full disk keeps refusing once it is full (a read-only mount refuses all).
NEEDS_SPACE = {"write", "flush", "close", "fsync"}


def listener(fault: dict | None, trace: list | None, within: str):
    """The seam's listener for one child: records the checkpoints met under `within` and
    acts on the `fault["nth"]` of them."""
    within = os.path.realpath(within)
    met, failing = [], []

    def listen(step: str, path: Path) -> None:
        real = os.path.realpath(path)
        if not (real == within or real.startswith(within + os.sep)):
            return
        if trace is not None:
            trace.append([step, os.path.relpath(real, within)])
        if fault is None:
            return
        if failing and (failing[0] == errno.EROFS or step in NEEDS_SPACE):
            raise OSError(failing[0], os.strerror(failing[0]))
        met.append(step)
        if len(met) != fault["nth"]:
            return
        action = fault["action"]
        if action in SIGNALS:
            os.kill(os.getpid(), SIGNALS[action])  # a handled signal raises right here
            return
        failing.append(ERRNOS[action])
        raise OSError(failing[0], os.strerror(failing[0]))

    return listen


def child(request: dict, out: Path, err: Path) -> None:
    code = 0
    trace: list | None = [] if request.get("trace") else None
    try:
        os.chdir(request["cwd"])
        for fd, path in ((1, out), (2, err)):
            handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(handle, fd)
            os.close(handle)
        os.environ.update(request.get("env") or {})
        within = request.get("within") or request["cwd"]
        with fsutil.injected(listener(request.get("fault"), trace, within)):
            if "api" in request:
                code = faultkit.run_api(request["api"], request.get("args") or [])
            else:
                try:
                    app(request["argv"], prog_name="seqkv", standalone_mode=True)
                except SystemExit as done:
                    code = done.code if isinstance(done.code, int) else int(done.code is not None)
    except BaseException:  # whatever escaped is the finding: shown as it is
        traceback.print_exc()
        code = 1
    finally:
        if trace is not None:
            Path(request["trace"]).write_text(json.dumps(trace))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve() -> None:
    scratch = Path(tempfile.mkdtemp(prefix="seqkv-forkserver-"))
    for line in sys.stdin:
        request = json.loads(line)
        out, err = scratch / "out", scratch / "err"
        started = time.monotonic()
        pid = os.fork()
        if pid == 0:
            child(request, out, err)
        deadline = started + float(request.get("timeout", 300))
        kill_at = started + request["kill_after"] if request.get("kill_after") else None
        timed_out = False
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            now = time.monotonic()
            if kill_at is not None and now >= kill_at:
                os.kill(pid, signal.SIGKILL)
                kill_at = None
            if now >= deadline:
                timed_out = True
                os.kill(pid, signal.SIGKILL)
                deadline = float("inf")
            time.sleep(0.002)
        answer = {
            "rc": os.waitstatus_to_exitcode(status),
            "stdout": out.read_text(errors="replace"),
            "stderr": err.read_text(errors="replace"),
            "seconds": time.monotonic() - started,
            "timed_out": timed_out,
        }
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    # Ctrl-C as a terminal delivers it, whatever this server inherited: a shell starts a
    # background job (`pytest ... &`) with SIGINT ignored, and its children would ignore
    # the injected SIGINT and finish (exit 0, not 130).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    serve()
