#!/usr/bin/env bash
# The GPU machine's check (MLX's CUDA backend on an NVIDIA GPU): the test suite with the GPU as MLX's
# default device (the fused kernels run in tests/test_fused.py, in the oracle property tests and in
# the generation loop), one pytest process per test file, each with its own time limit (so one
# slow file cannot hide the others' results), several files at a time (on the GPU each new shape
# compiles its kernels at run time, on the CPU cores); then the kernel counts, the acceptance
# benchmark (with the fused kernels and the PyTorch peer) at V = 152064, N = 4, 8, 16, and the
# greedy-kernel candidates (benchmarks/fused_greedy.py). A summary line per test file comes last.
# Run from the repo root after MLX's CUDA build is installed (../shared/tools/mlx-cuda/README.md).
# Output: $OUT (or /tmp/gpu-check): tests.log (every file's verbose log, one after another),
# kernels.txt, acceptance.txt, acceptance.json, fused_greedy.txt.
# Usage: bash scripts/gpu-check.sh [--no-bench | --bench-only] [--limit SECONDS] [--jobs J]
#                                  [TEST_FILE ...]
#   (no files: every tests/test_*.py; --limit: per file, default 240; --jobs: files at a time,
#   default 4)
set -uo pipefail
out=${OUT:-/tmp/gpu-check}
logs=/tmp/gpu-check-logs
mkdir -p "$out" "$logs"
export PYTHONPATH=/tmp/mlx-site:/tmp/site:$PWD PYTHONUNBUFFERED=1
# Kernels compiled at run time (NVRTC) are kept for the other test files.
export MLX_PTX_CACHE_DIR=${MLX_PTX_CACHE_DIR:-/tmp/mlx-ptx-cache}
python3 -c "import mlx.core as mx; assert mx.default_device() == mx.gpu, mx.default_device(); print('MLX', mx.__version__, mx.default_device())" || exit 1
bench=1 tests=1 limit=240 jobs=4 files=()
while [ $# -gt 0 ]; do
  case "$1" in
    --no-bench) bench=0 ;;
    --bench-only) tests=0 ;;
    --limit) limit=$2; shift ;;
    --jobs) jobs=$2; shift ;;
    *) files+=("$1") ;;
  esac
  shift
done
[ ${#files[@]} -eq 0 ] && files=(tests/test_*.py)

# One file: its verbose log (the last line names the test running when a limit struck) and a
# summary line.
run_file() {
  local file=$1 name start rc last per_test=()
  name=$(basename "$file" .py)
  # One slow test fails alone (with its traceback) instead of taking the file's whole limit.
  python3 -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout "$(( limit / 2 ))")
  start=$(date +%s)
  timeout "$limit" python3 -m pytest --full -v -p no:cacheprovider -rf --tb=short --durations=5 \
    "${per_test[@]}" "$file" > "$logs/$name.log" 2>&1
  rc=$?
  last=$(grep -E "(passed|failed|error).* in " "$logs/$name.log" | tail -n 1)
  [ "$rc" = 124 ] && last="timed out after ${limit}s, at: $(grep -E '::' "$logs/$name.log" | tail -n 1)"
  echo "$name ($(( $(date +%s) - start )) s): ${last:-rc $rc}" > "$logs/$name.summary"
}
export -f run_file
export limit logs

if [ "$tests" = 1 ]; then
  rm -f "$logs"/*.log "$logs"/*.summary
  printf '%s\n' "${files[@]}" | xargs -P "$jobs" -I{} bash -c 'run_file "$1"' _ {}
  for file in "${files[@]}"; do
    name=$(basename "$file" .py)
    { echo "===== $name"; cat "$logs/$name.log"; } >> "$out/tests.log"
    grep -E "^FAILED|^ERROR|^E  " "$logs/$name.log" | head -n 12
  done
fi
if [ "$bench" = 1 ]; then
  timeout 60 python3 benchmarks/kernels.py 2>&1 | tee "$out/kernels.txt" | cut -c1-60
  timeout 240 python3 benchmarks/acceptance.py --vocabs 152064 --drafts 4 8 16 --repeats 30 \
    --json "$out/acceptance.json" 2>/dev/null | tee "$out/acceptance.txt"
  timeout 120 python3 benchmarks/fused_greedy.py 2>&1 | tee "$out/fused_greedy.txt"
fi
[ "$tests" = 1 ] && { echo; cat "$logs"/*.summary; }
