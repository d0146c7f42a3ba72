"""Verification-sized attention on MLX's CUDA backend: cuDNN's graphs against MLX's own kernel.

For a call with more than one query, MLX's CUDA backend runs attention through a cuDNN graph built
for each new (query length, key length), and keeps a bounded number of them. A speculative round
scores ``N + 1`` queries against a cache one round longer than the last, so nearly every round
meets a new shape. This times ``mx.fast.scaled_dot_product_attention`` at the shapes of such
rounds (the heads and head size of a 16 x 2048 llama, bfloat16), in two processes: one with cuDNN
(MLX's default) and one with ``MLX_CUDA_USE_CUDNN_SDPA=0`` (MLX's own kernel):

- first use: the first call of each shape (a new graph for cuDNN);
- steady state: the median of later calls of the same shape.

It prints one table of milliseconds and the ratios without / with cuDNN. On other backends it says
so and stops.

Usage: ``python benchmarks/cuda_attention.py [--queries 1 2 5 9 17] [--keys 256 1024 4096]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 64
REPEATS = 20


def measure(queries: list[int], keys: list[int]) -> dict[str, list[float]]:
    """``{"q,k": [first_ms, steady_ms]}`` for each shape, in this process."""
    import mlx.core as mx

    out = {}
    for k in keys:
        for q in queries:
            args = [
                mx.random.normal((1, h, n, HEAD_DIM)).astype(mx.bfloat16)
                for h, n in ((HEADS, q), (KV_HEADS, k), (KV_HEADS, k))
            ]
            mx.eval(args)
            first = _timed(args, q)
            steady = statistics.median(_timed(args, q) for _ in range(REPEATS))
            out[f"{q},{k}"] = [first, steady]
    return out


def _timed(args: list, queries: int) -> float:
    """Milliseconds of one attention call over ``args`` (queries, keys, values), evaluated."""
    import mlx.core as mx

    start = time.perf_counter()
    mask = "causal" if queries > 1 else None
    mx.eval(mx.fast.scaled_dot_product_attention(*args, scale=HEAD_DIM**-0.5, mask=mask))
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--queries", type=int, nargs="+", default=[1, 2, 5, 9, 17])
    parser.add_argument("--keys", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.queries, args.keys)))
        return
    import mlx.core as mx

    if not (mx.cuda.is_available() and mx.default_device() == mx.gpu):
        print(f"cuda_attention: needs MLX's CUDA backend, got {mx.default_device()}")
        return
    command = [sys.executable, __file__, "--child", "--queries", *map(str, args.queries)]
    command += ["--keys", *map(str, args.keys)]
    runs = {}
    for name, value in (("cudnn", "1"), ("mlx", "0")):
        env = {**os.environ, "MLX_CUDA_USE_CUDNN_SDPA": value}
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
        runs[name] = json.loads(done.stdout.strip().splitlines()[-1])
    print(
        f"# attention, {HEADS} heads ({KV_HEADS} for keys) x {HEAD_DIM}, bfloat16, MLX "
        f"{mx.__version__}; ms, first call and median of {REPEATS} later calls"
    )
    print(
        "| queries | keys | cuDNN first | cuDNN steady | MLX first | MLX steady | "
        "MLX / cuDNN steady |"
    )
    print("|---|---|---|---|---|---|---|")
    for shape, (first, steady) in runs["cudnn"].items():
        q, k = shape.split(",")
        own_first, own_steady = runs["mlx"][shape]
        print(
            f"| {q} | {k} | {first:.3f} | {steady:.3f} | {own_first:.3f} | {own_steady:.3f} | "
            f"{own_steady / steady:.2f}x |"
        )


if __name__ == "__main__":
    main()
