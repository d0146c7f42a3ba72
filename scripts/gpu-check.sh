#!/usr/bin/env bash
# The GPU machine's check (MLX's CUDA backend on an NVIDIA GPU): the whole test suite with the GPU as
# MLX's default device, the kernel counts, then the acceptance benchmark with its PyTorch peer.
# One table at the end. Run from the repo root after MLX's CUDA build is installed
# (../shared/tools/mlx-cuda/README.md); logs go to $OUT (or /tmp/gpu-check).
# Usage: bash scripts/gpu-check.sh [--quick]
set -uo pipefail
out=${OUT:-/tmp/gpu-check}
mkdir -p "$out"
export PYTHONPATH=/tmp/mlx-site:/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -c "import mlx.core as mx; assert mx.default_device() == mx.gpu, mx.default_device(); print('MLX', mx.__version__, mx.default_device())" || exit 1
timeout 330 python3 -m pytest --full -q -p no:cacheprovider 2>&1 | tee "$out/pytest.log" | tail -n 25
timeout 60 python3 benchmarks/kernels.py 2>&1 | tee "$out/kernels.txt"
if [ "${1:-}" = "--quick" ]; then args="--quick"; else args=""; fi
timeout 200 python3 benchmarks/acceptance.py $args --repeats 25 --json "$out/acceptance.json" 2>/dev/null | tee "$out/acceptance.txt"
