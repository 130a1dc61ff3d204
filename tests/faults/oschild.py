"""A child process that runs one seqkv command with one OS call made to kill, signal or fail it.

    python oschild.py PLAN_JSON seqkv-args...        # the CLI, as `seqkv` runs it
    python oschild.py PLAN_JSON --api-add ARCHIVE MODEL_DIR SESSION_ID TOKEN_IDS_JSON

PLAN: {"call": "replace"|"fsync"|"link"|"chmod", "nth": N, "action": "kill"|"term"|"int"}
acts at the N-th call of `os.<call>` (1-based), counting only calls on a path inside
`"within": DIR` if given (fsync: the path of its descriptor) and, with `"visible": true`, only
calls whose path (replace, link: the destination) is not a hidden name: a publish under the
real name, whatever a writer staged before it. {"watch": DIR} instead kills the process the
moment a file whose name starts with ".tmp" appears in DIR or a folder inside it (a library's
own temporary, mid-write). The OS functions are patched, not a seqkv seam, so this child fails
the same way on code that has no seam: the regression tests of issue 37 run it.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

ACTIONS = {"kill": signal.SIGKILL, "term": signal.SIGTERM, "int": signal.SIGINT}


def arm(plan: dict) -> None:
    if "watch" in plan:
        threading.Thread(target=_watch, args=(plan["watch"],), daemon=True).start()
        return
    name, nth, sig = plan["call"], int(plan["nth"]), ACTIONS[plan["action"]]
    within, visible = plan.get("within"), plan.get("visible", False)
    real, calls = getattr(os, name), []

    def counts(args) -> bool:
        if name == "fsync":
            path = os.readlink(f"/proc/self/fd/{args[0]}")
        else:
            path = os.fspath(args[1] if name in ("replace", "link") else args[0])
        path = os.path.abspath(path)
        if within is not None and not path.startswith(os.path.abspath(within) + os.sep):
            return False
        return not (visible and os.path.basename(path).startswith("."))

    def patched(*args, **kwargs):
        if counts(args):
            calls.append(1)
            if len(calls) == nth:
                os.kill(os.getpid(), sig)  # a handled signal raises right here, before the call
        return real(*args, **kwargs)

    setattr(os, name, patched)


def _watch(folder: str) -> None:
    while True:
        for _root, _dirs, files in os.walk(folder):
            if any(f.startswith(".tmp") for f in files):
                os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.0005)


def api_add(archive: str, model_dir: str, session_id: str, ids_json: str) -> None:
    import seqkv_cli

    with seqkv_cli.open_archive(archive, model=model_dir) as arc:
        arc.add(session_id, json.loads(ids_json))


if __name__ == "__main__":
    arm(json.loads(sys.argv[1]))
    if sys.argv[2] == "--api-add":
        api_add(*sys.argv[3:7])
    else:
        sys.argv = ["seqkv", *sys.argv[2:]]
        from seqkv_cli.cli import main

        main()
