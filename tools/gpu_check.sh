#!/usr/bin/env bash
# Everything a device must prove, in one command that ends inside its budget: build,
# JIT warm-up, pytest -m gpu --gpu=device, every format's kernels against the CPU,
# compute-sanitizer, the benchmark; a summary table last. The stages are in
# tools/gpu_check.py (read its docstring; docs/gpu.md "On a GPU machine").
#
#   tools/gpu_check.sh [--budget SECONDS] [--emulate] [--only STAGE,...] [--sanitize-formats F,...|all] [OUTPUT_DIR] [-- PYTEST_ARGS...]
#
# --budget: seconds for everything (default 480: give the machine's command 540).
# --emulate: the dry run on the CPU emulator (tiny sizes, no device figures).
# --only: the stages to run (a rerun of what failed, with the time left).
# OUTPUT_DIR (default: a new temp dir) receives at most 8 files, summary.txt last.
# PYTEST_ARGS replace the pytest stage's test files (default: the gpu test files; paths
# relative to the checkout).
set -uo pipefail
ARGS=()
while (( $# )); do
    case "$1" in
        --) ARGS+=("$@"); break ;;
        --budget|--only|--sanitize-formats) ARGS+=("$1" "${2:?$1 needs a value}"); shift ;;
        -*) ARGS+=("$1") ;;
        *) ARGS+=(--out "$(realpath -m "$1")") ;;
    esac
    shift
done
cd "$(dirname "$0")/.." || exit 2
exec "${PYTHON:-python3}" tools/gpu_check.py ${ARGS[@]+"${ARGS[@]}"}
