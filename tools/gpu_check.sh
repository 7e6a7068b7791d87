#!/usr/bin/env bash
# Everything that needs the GPU, in one go, on a machine with an NVIDIA device:
#   build the extensions in place, pytest -m gpu, tools/bench_gpu.py, compute-sanitizer
#   memcheck (and racecheck with --racecheck) over the gpu tests, a summary last.
#
#   tools/gpu_check.sh [--racecheck] [OUTPUT_DIR [PYTEST_ARGS...]]
#
# OUTPUT_DIR (default: a new temp dir) receives one log per stage; PYTEST_ARGS (test
# files, -k ...) narrow the tests both pytest runs take (default: every gpu test).
# Every stage runs even when an earlier one fails; the exit status is non-zero when any
# failed.
set -uo pipefail
cd "$(dirname "$0")/.."

RACECHECK=0
if [[ "${1:-}" == "--racecheck" ]]; then RACECHECK=1; shift; fi
OUT="${1:-$(mktemp -d)}"
shift || true
TESTS=("$@")
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
declare -a SUMMARY
FAILED=0

stage() {  # stage NAME COMMAND...: runs it, tees its log, records pass/fail and the time
    local name="$1"; shift
    local t0=$SECONDS
    echo "=== $name: $*"
    "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    local line
    line="$(grep -E '(passed|failed|error|ERROR SUMMARY)' "$OUT/$name.log" | tail -1)"
    SUMMARY+=("$(printf '%-10s rc=%-3s %4ss  %s' "$name" "$rc" "$((SECONDS - t0))" "$line")")
    [[ $rc -eq 0 ]] || FAILED=1
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | tee "$OUT/device.log"
stage build python3 setup.py build_ext --inplace -q
stage gpu-tests python3 -m pytest -m gpu --gpu=device -x -q -p no:cacheprovider "${TESTS[@]}"
stage bench python3 tools/bench_gpu.py
stage memcheck compute-sanitizer --tool memcheck --error-exitcode 1 \
    python3 -m pytest -m gpu --gpu=device -q -p no:cacheprovider "${TESTS[@]}"
if [[ $RACECHECK -eq 1 ]]; then
    stage racecheck compute-sanitizer --tool racecheck --error-exitcode 1 \
        python3 -m pytest -m gpu --gpu=device -q -p no:cacheprovider "${TESTS[@]}"
fi

echo
echo "=== summary (logs in $OUT)"
printf '%s\n' "${SUMMARY[@]}"
exit $FAILED
