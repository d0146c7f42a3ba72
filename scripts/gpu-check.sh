#!/usr/bin/env bash
# The GPU machine's check (MLX's CUDA backend on an NVIDIA GPU), in four parts:
# - tests: the whole test suite with the GPU as MLX's default device (the fused kernels run in
#   tests/test_fused.py, in the oracle property tests and in the generation loop), in one pytest
#   with several worker processes sharing the GPU (pytest-xdist: on the GPU each new shape compiles
#   its kernels at run time, on the CPU cores) and a limit per test;
# - bench: the kernel counts, the acceptance benchmark (with the fused kernels and the PyTorch
#   peer) at V = 152064, N = 4, 8, 16, one process per N (in one process the configurations
#   measured later read slower), MLX's cost per evaluation (benchmarks/overhead.py), the greedy
#   kernels compared (benchmarks/fused_greedy.py) and verification-sized attention with and
#   without cuDNN (benchmarks/cuda_attention.py);
# - generation: benchmarks/generation.py on the GPU pairs, one process each (first use and steady
#   state of every method, interleaved): demo (both workloads), 16x2048 (open generation,
#   temperature 0 and 1), 16x4096 and hybrid (open generation, temperature 0 and 0.8; hybrid
#   also how taking recurrent caches back compares with an attention-only twin, each prompt run
#   4 times, as single runs on a shared GPU spread more than the effect). Its JSON is written
#   after each row, so a pair
#   cut by its time limit keeps what it measured. MLX's own attention kernel, as `mlx-spec
#   generate` chooses, unless MLX_CUDA_USE_CUDNN_SDPA is set;
# - distributed (with 2 GPUs or more): benchmarks/distributed.py on the 16x2048 pair, the target
#   split over 2 GPUs (NCCL) against the whole target on one.
# The tests' summary line comes last. Where one call has a time limit or returns few files, run the
# parts in separate calls (--no-bench, --bench-only, --generation-only, --distributed-only; --pair
# to split the pairs).
# Run from the repo root with MLX's CUDA build importable (installed, or on PYTHONPATH, which the
# script extends with the repo root).
# Output: $OUT (or /tmp/gpu-check): tests.log (the verbose log); kernels.txt, acceptance.txt,
# acceptance-N.json, overhead.txt, fused_greedy.txt, attention.txt; generation.txt (the tables)
# and generation-PAIR.json (the raw rows); distributed.txt and distributed.json.
# Usage: bash scripts/gpu-check.sh [--no-bench | --bench-only | --generation-only
#                                   | --distributed-only] [--pair PAIR]...
#                                  [--limit SECONDS] [--pair-limit SECONDS] [--jobs J]
#                                  [TEST_FILE ...]
#   (no files: every tests/test_*.py; --limit: for the tests, default 480, and three quarters of it
#   for one test, since the slowest, a hypothesis test of many small shapes, compiles a kernel for
#   each; --jobs: worker processes, default 14; --pair: demo, 16x2048, 16x4096 or hybrid, default
#   all four; --pair-limit: for each pair's generation benchmark and for the distributed one,
#   default 280)
set -uo pipefail
out=${OUT:-/tmp/gpu-check}
mkdir -p "$out"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
# Kernels compiled at run time (NVRTC) are kept for the other workers and the benchmarks.
export MLX_PTX_CACHE_DIR=${MLX_PTX_CACHE_DIR:-/tmp/mlx-ptx-cache}
python3 -c "import mlx.core as mx; assert mx.default_device() == mx.gpu, mx.default_device(); print('MLX', mx.__version__, mx.default_device())" || exit 1
tests=1 bench=1 generation=1 distributed=1 limit=480 pair_limit=280 jobs=14 files=() pairs=()
while [ $# -gt 0 ]; do
  case "$1" in
    --no-bench) bench=0 generation=0 distributed=0 ;;
    --bench-only) tests=0 generation=0 distributed=0 ;;
    --generation-only) tests=0 bench=0 distributed=0 ;;
    --distributed-only) tests=0 bench=0 generation=0 ;;
    --pair) pairs+=("$2"); shift ;;
    --pair-limit) pair_limit=$2; shift ;;
    --limit) limit=$2; shift ;;
    --jobs) jobs=$2; shift ;;
    *) files+=("$1") ;;
  esac
  shift
done
[ ${#files[@]} -eq 0 ] && files=(tests/test_*.py)
[ ${#pairs[@]} -eq 0 ] && pairs=(demo 16x2048 16x4096 hybrid)

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
  timeout 120 python3 benchmarks/cuda_attention.py 2>&1 | tee "$out/attention.txt"
fi
# cuDNN builds an attention graph for each new shape of a verification: the first use of every
# cache length would measure graph builds (benchmarks/cuda_attention.py shows both).
export MLX_CUDA_USE_CUDNN_SDPA=${MLX_CUDA_USE_CUDNN_SDPA:-0}
if [ "$generation" = 1 ]; then
  declare -A options=(
    [demo]=""
    [16x2048]="--workload open --temps 0 1"
    [16x4096]="--workload open"
    [hybrid]="--workload open --repeats 4"
  )
  : > "$out/generation.txt"
  for pair in "${pairs[@]}"; do
    # shellcheck disable=SC2086  # the options are words
    timeout "$pair_limit" python3 benchmarks/generation.py --pair "$pair" --prompts 2 --tokens 128 \
      ${options[$pair]} --json "$out/generation-$pair.json" 2>/dev/null | tee -a "$out/generation.txt"
    [ "${PIPESTATUS[0]}" = 124 ] && echo "(--pair $pair cut at ${pair_limit}s)" | tee -a "$out/generation.txt"
    echo >> "$out/generation.txt"
  done
fi
gpus=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU")
if [ "$distributed" = 1 ] && [ "$gpus" -ge 2 ]; then
  launch=(mlx.launch)
  # MLX's launcher, also where its console script is not on PATH.
  command -v mlx.launch > /dev/null || launch=(python3 -c \
    "import sys; from mlx._distributed_utils.launch import main; sys.argv[0] = 'mlx.launch'; main()")
  # NVLink multicast (NVLS) stays off: the lent machines do not support it.
  timeout "$pair_limit" "${launch[@]}" --backend nccl -n 2 --env NCCL_NVLS_ENABLE=0 \
    --env PYTHONPATH="$PYTHONPATH" --env MLX_CUDA_USE_CUDNN_SDPA="$MLX_CUDA_USE_CUDNN_SDPA" \
    --env MLX_PTX_CACHE_DIR="$MLX_PTX_CACHE_DIR" -- python3 benchmarks/distributed.py \
    --pair 16x2048 --whole --workload open --json "$out/distributed.json" 2>/dev/null \
    | tee "$out/distributed.txt"
fi
[ "$tests" = 1 ] && { echo; echo "$summary"; }
exit 0
