#!/usr/bin/env bash
# Shortcut for the one benchmark command documented in docs/BENCHMARKS.md:
#     python -m bench.suite.run --append docs/BENCHMARKS_LOG.md
# Extra arguments are passed on (e.g. --quick, --threads 2). Python: $PYTHON, else .venv.
set -euo pipefail
cd "$(dirname "$0")/../.."
exec "${PYTHON:-.venv/bin/python}" -m bench.suite.run --append docs/BENCHMARKS_LOG.md "$@"
