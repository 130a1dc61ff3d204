#!/usr/bin/env bash
# The tests marked `slow` (pyproject.toml [tool.pytest.ini_options]): the default pytest run
# deselects them to keep .ci/run under ~30 minutes; this runs them (tens of minutes on 2 CPU
# cores). Extra arguments go to pytest, e.g. bench/slow_tests.sh tests/archive -x
set -euo pipefail
cd "$(dirname "$0")/.."
# -n 0: one process, one test at a time: the real-shape tests each need much of the memory
exec .venv/bin/pytest -m slow -n 0 "$@"
