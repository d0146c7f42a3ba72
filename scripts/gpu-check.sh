#!/usr/bin/env bash
# The GPU machine's check (MLX's CUDA backend on an NVIDIA GPU): the test suite with the GPU as MLX's
# default device, one test file at a time (each with its own time limit, so one slow file cannot hide
# the others' results), the kernel counts, then the acceptance benchmark with its PyTorch peer.
# A summary line per test file and the benchmark table come last.
# Run from the repo root after MLX's CUDA build is installed (../shared/tools/mlx-cuda/README.md);
# logs go to $OUT (or /tmp/gpu-check).
# Usage: bash scripts/gpu-check.sh [--quick] [SECONDS_PER_FILE]
set -uo pipefail
out=${OUT:-/tmp/gpu-check}
mkdir -p "$out"
export PYTHONPATH=/tmp/mlx-site:/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -c "import mlx.core as mx; assert mx.default_device() == mx.gpu, mx.default_device(); print('MLX', mx.__version__, mx.default_device())" || exit 1
if [ "${1:-}" = "--quick" ]; then bench="--quick"; shift; else bench=""; fi
limit=${1:-240}
summary=""
for file in tests/test_*.py; do
  name=$(basename "$file" .py)
  timeout "$limit" python3 -m pytest --full -q -p no:cacheprovider -rf --tb=line --durations=5 \
    "$file" > "$out/$name.log" 2>&1
  rc=$?
  last=$(grep -E "passed|failed|error" "$out/$name.log" | tail -n 1)
  [ "$rc" = 124 ] && last="timed out after ${limit}s: $(grep -c . "$out/$name.log") lines of output"
  summary+="$name: ${last:-rc $rc}"$'\n'
  grep -E "^FAILED|^ERROR" "$out/$name.log" | head -n 5
done
timeout 60 python3 benchmarks/kernels.py 2>&1 | tee "$out/kernels.txt" | cut -c1-40
timeout 200 python3 benchmarks/acceptance.py $bench --repeats 25 --json "$out/acceptance.json" \
  2>/dev/null | tee "$out/acceptance.txt"
printf '\n%s' "$summary"
