#!/usr/bin/env bash
# The prepared GPU check for a lent machine (e.g. one H200), in one call: the CUDA entropy
# kernels against the CPU coder (byte identity at scale, GB/s on 256 MB of bf16 K/V byte
# planes, the CPU/GPU crossover), whole .skv files written and restored with --device cpu and
# cuda (portable path; per-vector codecs with their entropy streams on the GPU), the portable
# forward on the device, token-coder tables and tokens/s with 64 sessions in lockstep
# (bench/gpu/check.py lists the steps). Installs nothing and downloads nothing: it runs in a
# copy of the repository with either a prepared venv carried in (.venv/) or a system Python
# whose torch has CUDA; the entropy steps need numba with its CUDA target (numba-cuda on the
# lent image). The model is the embedded model's shape with random weights, so no weights need
# to be on the machine.
#
# Usage: bash bench/gpu/check.sh [OUT_DIR] [--cpu-dry-run] [--only=STEP,...] [--budget=SECONDS]
#                                [--kv-mb=N --sessions=N --tokens=N]
#   OUT_DIR defaults to $OUT (the device runner's output folder), else bench/results/gpu.
#   --budget: seconds for the whole run (default 470: an 8-minute device call with margin);
#     a step that would not finish in what is left is skipped and named in the report.
#   --cpu-dry-run runs the same code on CPU at tiny sizes, the entropy kernels under numba's
#     CUDA simulator (to show it does not crash; slow: ~10 min on 2 cores).
# Each step runs in its own process under `timeout` (a CUDA error or a crash in one cannot
# take the others' results with it); OUT_DIR/gpu_check.md and gpu_check.json are rewritten
# after every step and end with what to run next. Exit status: 0 when every step ran.
# The whole-file steps (bench/gpu/files.py: `python -m seqkv_cli ... --device cpu|cuda`) also
# need seqkv's runtime packages; they report "skipped" naming any that are missing (on the
# lent H200 image, google-crc32c was: carry it as a wheel and install it with --target first).
set -uo pipefail
cd "$(dirname "$0")/../.."

out="" dry=0 only="" budget="" extra=()
for arg in "$@"; do
    case "$arg" in
        --cpu-dry-run) dry=1 ;;
        --only=*) only=${arg#--only=} ;;
        --budget=*) budget=${arg#--budget=} ;;
        --*) extra+=("$arg") ;;
        *) if [[ -z "$out" ]]; then out="$arg"; else extra+=("$arg"); fi ;;
    esac
done
out=${out:-${OUT:-bench/results/gpu}}
budget=${budget:-$([[ $dry -eq 1 ]] && echo 3600 || echo 470)}

py=${PYTHON:-}
for candidate in .venv/bin/python python3 python; do
    [[ -n "$py" ]] && break
    command -v "$candidate" >/dev/null 2>&1 && py=$candidate
done
if [[ -z "$py" ]]; then
    echo "gpu_check: no Python found (set PYTHON=/path/to/python)" >&2
    exit 2
fi
# The repository's packages without installing them; the venv may already have them.
export PYTHONPATH="$PWD:$PWD/codecs${PYTHONPATH:+:$PYTHONPATH}"
# the dry run's entropy kernels run in numba's CUDA simulator (set before numba is imported)
[[ $dry -eq 1 ]] && export NUMBA_ENABLE_CUDASIM=1

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
numba=$("$py" -c "from numba import cuda; print(int(cuda.is_available()))" 2>&1 | tail -1)
[[ "$numba" != "1" ]] && echo "gpu_check: numba's CUDA target is not usable here ($numba):" \
    "the entropy steps will report it and the others still run." >&2
[[ $dry -eq 1 ]] && extra+=(--cpu-dry-run)

# seconds each step may take on one H200 (generous: the first run had no timings to go by)
declare -A limit=([entropy_identity]=150 [entropy_speed]=150 [entropy_crossover]=60
    [files]=200 [portable]=120 [tables]=40 [canonical]=60 [files_many]=200 [token_coder]=240)
steps=(entropy_identity entropy_speed entropy_crossover files portable tables canonical
    files_many token_coder)
[[ -n "$only" ]] && IFS=, read -r -a steps <<<"$only"
mkdir -p "$out"
# a fresh report unless --only adds to an earlier one
[[ -z "$only" ]] && rm -f "$out/gpu_check.json" "$out/gpu_check.md"

start=$SECONDS status=0
for step in "${steps[@]}"; do
    left=$((budget - (SECONDS - start)))
    cap=${limit[$step]:-300}
    [[ $dry -eq 1 ]] && cap=900
    if ((left < 30)); then
        echo "gpu_check: $step skipped: $left s of the ${budget}-s budget left" >&2
        "$py" -m bench.gpu.check --out "$out" "${extra[@]}" \
            --record "$step=skipped: the ${budget}-s budget ran out before it started"
        status=1
        continue
    fi
    ((cap > left - 10)) && cap=$((left - 10))
    echo "gpu_check: $step (at most $cap s)"
    timeout --kill-after=10 "$cap" "$py" -m bench.gpu.check --out "$out" --only "$step" \
        "${extra[@]}"
    rc=$?
    if ((rc != 0)); then
        why="exit $rc"
        ((rc == 124 || rc == 137)) && why="timed out after $cap s"
        echo "gpu_check: $step: $why" >&2
        "$py" -m bench.gpu.check --out "$out" "${extra[@]}" --record "$step=$why"
        status=1
    fi
done
echo "gpu_check: $((SECONDS - start)) s; report in $out/gpu_check.md"
sed -n '/^### Next/,$p' "$out/gpu_check.md" 2>/dev/null
exit $status
