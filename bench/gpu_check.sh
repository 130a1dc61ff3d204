#!/usr/bin/env bash
# The prepared GPU check for a lent machine (e.g. one H200): CPU/GPU byte identity of the
# entropy coder and of the token coder's frequency tables, and GPU speed (entropy coder GB/s
# on 256 MB of K/V; token-coder tokens/s with 64 sessions in lockstep). Installs nothing and
# downloads nothing: it runs in a copy of the repository with either a prepared venv carried
# in (.venv/) or a system Python whose torch has CUDA. The model is the embedded model's shape
# with random weights (bench/gpu_tokens.py), so no weights need to be on the machine.
#
# Usage: bash bench/gpu_check.sh [OUT_DIR] [--cpu-dry-run] [--kv-mb=N --sessions=N --tokens=N]
#   OUT_DIR defaults to $OUT (the device runner's output folder), else bench/results/gpu.
#   --cpu-dry-run runs the same code on CPU at tiny sizes (to show it does not crash).
# Writes OUT_DIR/gpu_check.md and OUT_DIR/gpu_check.json. Needs: python >= 3.11, torch, numpy.
# The whole-file step (bench/gpu_files.py: `python -m seqkv_cli ... --device cpu|cuda`) also
# needs seqkv's runtime packages; it reports "skipped" naming any that are missing. On the
# H200 image google-crc32c is not installed (as last listed): carry it as a wheel
# (`.whl`, see /work/.library/device/README.md) and install it with --target first.
set -uo pipefail
cd "$(dirname "$0")/.."

out="" dry=0 extra=()
for arg in "$@"; do
    case "$arg" in
        --cpu-dry-run) dry=1 ;;
        --*) extra+=("$arg") ;;
        *) if [[ -z "$out" ]]; then out="$arg"; else extra+=("$arg"); fi ;;
    esac
done
out=${out:-${OUT:-bench/results/gpu}}

py=${PYTHON:-}
for candidate in .venv/bin/python /work/venv/bin/python python3 python; do
    [[ -n "$py" ]] && break
    command -v "$candidate" >/dev/null 2>&1 && py=$candidate
done
if [[ -z "$py" ]]; then
    echo "gpu_check: no Python found (set PYTHON=/path/to/python)" >&2
    exit 2
fi
# The repository's packages without installing them; the venv may already have them.
export PYTHONPATH="$PWD:$PWD/codecs${PYTHONPATH:+:$PYTHONPATH}"

missing=$("$py" - <<'EOF'
import importlib.util, sys
need = ("torch", "numpy")
print(" ".join(m for m in need if importlib.util.find_spec(m) is None))
if sys.version_info < (3, 11):
    print("python>=3.11", end="")
EOF
)
if [[ -n "$missing" ]]; then
    echo "gpu_check: $py lacks: $missing. Carry a prepared venv as .venv/ or use a" \
        "system Python that has them; this script installs nothing." >&2
    exit 2
fi
cuda=$("$py" -c "import torch; print(int(torch.cuda.is_available()), torch.__version__, torch.version.cuda)")
echo "gpu_check: $py, torch $(cut -d' ' -f2 <<<"$cuda"), CUDA build $(cut -d' ' -f3 <<<"$cuda")"
if [[ $dry -eq 0 && "${cuda%% *}" != "1" ]]; then
    echo "gpu_check: torch.cuda.is_available() is False for $py (a CPU-only torch build, or" \
        "no driver/GPU visible). Use a Python with a CUDA torch, or --cpu-dry-run." >&2
    exit 3
fi
[[ $dry -eq 1 ]] && extra+=(--cpu-dry-run)
exec "$py" -m bench.gpu_check --out "$out" "${extra[@]}"
