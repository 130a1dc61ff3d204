#!/usr/bin/env bash
# The one benchmark command: every codec on the embedded model, in one run on one machine.
# Appends Markdown tables to docs/BENCHMARKS.md (or $1) and writes raw JSON to bench/results/.
# Usage: bash bench/run_all.sh   (from a checkout set up with README command 2)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=${1:-docs/BENCHMARKS.md}
mkdir -p bench/results
{
    echo
    echo "# Run of \`bash bench/run_all.sh\` — $(date -u +%Y-%m-%dT%H:%MZ), $(nproc) cores, $(uname -m)"
} >> "$OUT"
"$PY" bench/bench_codecs.py --append "$OUT" --json bench/results/codecs.json
"$PY" bench/bench_seq.py --append "$OUT" --json bench/results/seq.json
"$PY" bench/bench_delta_topk.py --append "$OUT" --json bench/results/delta_topk.json
