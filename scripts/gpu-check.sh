#!/usr/bin/env bash
# The GPU machine's check (MLX's CUDA backend on an NVIDIA GPU): the whole test suite with the GPU
# as MLX's default device (the fused kernels run in tests/test_fused.py, in the oracle property
# tests and in the generation loop), in one pytest with several worker processes sharing the GPU
# (pytest-xdist: on the GPU each new shape compiles its kernels at run time, on the CPU cores) and
# a limit per test; then the kernel counts, the acceptance benchmark (with the fused kernels and
# the PyTorch peer) at V = 152064, N = 4, 8, 16, one process per N (in one process the
# configurations measured later read slower), MLX's cost per evaluation (benchmarks/overhead.py)
# and the greedy kernels compared (benchmarks/fused_greedy.py). The tests' summary line comes last.
# Where one call has a time limit, run the tests and the benchmarks in two calls (--no-bench, then
# --bench-only).
# Run from the repo root with MLX's CUDA build importable (installed, or on PYTHONPATH, which the
# script extends with the repo root).
# Output: $OUT (or /tmp/gpu-check): tests.log (the verbose log), kernels.txt, acceptance.txt,
# acceptance-N.json, overhead.txt, fused_greedy.txt.
# Usage: bash scripts/gpu-check.sh [--no-bench | --bench-only] [--limit SECONDS] [--jobs J]
#                                  [TEST_FILE ...]
#   (no files: every tests/test_*.py; --limit: for the tests, default 480, and three quarters of it
#   for one test, since the slowest, a hypothesis test of many small shapes, compiles a kernel for
#   each; --jobs: worker processes, default 14)
set -uo pipefail
out=${OUT:-/tmp/gpu-check}
mkdir -p "$out"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
# Kernels compiled at run time (NVRTC) are kept for the other workers and the benchmarks.
export MLX_PTX_CACHE_DIR=${MLX_PTX_CACHE_DIR:-/tmp/mlx-ptx-cache}
python3 -c "import mlx.core as mx; assert mx.default_device() == mx.gpu, mx.default_device(); print('MLX', mx.__version__, mx.default_device())" || exit 1
bench=1 tests=1 limit=480 jobs=14 files=()
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

if [ "$tests" = 1 ]; then
  workers=() per_test=()
  python3 -c "import xdist" 2>/dev/null && workers=(-n "$jobs")
  python3 -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout "$(( limit * 3 / 4 ))")
  start=$(date +%s)
  timeout "$limit" python3 -m pytest --full -v -p no:cacheprovider -rf --tb=short --durations=15 \
    "${workers[@]}" "${per_test[@]}" "${files[@]}" > "$out/tests.log" 2>&1
  rc=$?
  summary=$(grep -E "(passed|failed|error).* in " "$out/tests.log" | tail -n 1)
  [ "$rc" = 124 ] && summary="timed out after ${limit}s, at: $(grep -E '::' "$out/tests.log" | tail -n 1)"
  summary="tests, ${#files[@]} files, ${workers[*]:-one process}: ${summary:-rc $rc} ($(( $(date +%s) - start )) s)"
  grep -E "^(FAILED|ERROR)" "$out/tests.log" | head -n 20
fi
if [ "$bench" = 1 ]; then
  timeout 60 python3 benchmarks/kernels.py 2>&1 | tee "$out/kernels.txt" | cut -c1-60
  : > "$out/acceptance.txt"
  for n in 4 8 16; do
    timeout 120 python3 benchmarks/acceptance.py --vocabs 152064 --drafts "$n" --repeats 60 \
      --json "$out/acceptance-$n.json" 2>/dev/null | tee -a "$out/acceptance.txt"
  done
  timeout 120 python3 benchmarks/overhead.py --drafts 4 8 16 2>&1 | tee "$out/overhead.txt"
  timeout 120 python3 benchmarks/fused_greedy.py 2>&1 | tee "$out/fused_greedy.txt"
fi
[ "$tests" = 1 ] && { echo; echo "$summary"; }
exit 0
