#!/usr/bin/env bash
# The GPU machine's check (MLX's CUDA backend on an NVIDIA GPU): the test suite with the GPU as MLX's
# default device (the fused kernels run in tests/test_fused.py, in the oracle property tests and in
# the generation loop), one test file at a time (each with
# its own time limit, so one slow file cannot hide the others' results), then the kernel counts, the
# acceptance benchmark (with the fused kernels and the PyTorch peer) at V = 152064, N = 4, 8, 16, and
# the greedy-kernel candidates (benchmarks/fused_greedy.py).
# A summary line per test file comes last.
# Run from the repo root after MLX's CUDA build is installed (../shared/tools/mlx-cuda/README.md);
# logs go to $OUT (or /tmp/gpu-check).
# Usage: bash scripts/gpu-check.sh [--no-bench | --bench-only] [--limit SECONDS] [TEST_FILE ...]
#   (no files: every tests/test_*.py; --no-bench: the tests only; --bench-only: the kernel counts
#   and benchmarks only). The whole suite takes longer than one device call: give it in parts.
set -uo pipefail
out=${OUT:-/tmp/gpu-check}
mkdir -p "$out"
export PYTHONPATH=/tmp/mlx-site:/tmp/site:$PWD PYTHONUNBUFFERED=1
# Kernels compiled at run time (NVRTC) are kept for the next test file.
export MLX_PTX_CACHE_DIR=${MLX_PTX_CACHE_DIR:-/tmp/mlx-ptx-cache}
python3 -c "import mlx.core as mx; assert mx.default_device() == mx.gpu, mx.default_device(); print('MLX', mx.__version__, mx.default_device())" || exit 1
bench=1 tests=1 limit=240 files=()
while [ $# -gt 0 ]; do
  case "$1" in
    --no-bench) bench=0 ;;
    --bench-only) tests=0 ;;
    --limit) limit=$2; shift ;;
    *) files+=("$1") ;;
  esac
  shift
done
[ ${#files[@]} -eq 0 ] && files=(tests/test_*.py)
summary=""
# One slow test fails alone (with its traceback) instead of taking its file's whole time limit.
per_test=()
python3 -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout "$(( limit / 2 ))")
if [ "$tests" = 1 ]; then
  for file in "${files[@]}"; do
    name=$(basename "$file" .py)
    start=$(date +%s)
    timeout "$limit" python3 -m pytest --full -q -p no:cacheprovider -rf --tb=short --durations=5 \
      "${per_test[@]}" "$file" > "$out/$name.log" 2>&1
    rc=$?
    last=$(grep -E "passed|failed|error" "$out/$name.log" | tail -n 1)
    [ "$rc" = 124 ] && last="timed out after ${limit}s: $(grep -c . "$out/$name.log") lines of output"
    summary+="$name ($(( $(date +%s) - start )) s): ${last:-rc $rc}"$'\n'
    grep -E "^FAILED|^ERROR|^E  " "$out/$name.log" | head -n 12
  done
fi
if [ "$bench" = 1 ]; then
  timeout 60 python3 benchmarks/kernels.py 2>&1 | tee "$out/kernels.txt" | cut -c1-60
  timeout 240 python3 benchmarks/acceptance.py --vocabs 152064 --drafts 4 8 16 --repeats 30 \
    --json "$out/acceptance.json" 2>/dev/null | tee "$out/acceptance.txt"
  timeout 120 python3 benchmarks/fused_greedy.py 2>&1 | tee "$out/fused_greedy.txt"
fi
printf '\n%s' "$summary"
