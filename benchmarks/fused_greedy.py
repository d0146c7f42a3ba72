"""Which greedy kernel next? The shipped one-block kernel against a two-launch candidate, on CUDA.

The shipped kernel (``mlx_spec.fused``, ``accept_greedy(..., fused=True)``) is one block that
reads rows one after another until the first mismatch, at the bandwidth of one multiprocessor: on
an H200 at V = 152064 it cost 0.126 ms at N = 4 but 0.171 ms at N = 16 (9 rows read), against
0.118 ms for the PyTorch peer. The candidate spreads the rows over many blocks: launch 1 takes the
argmax of 4096-column slices of every row (``[N + 1, S]`` partial maxima), launch 2 (one warp)
combines the slices row by row and decides. It reads every row, but at the whole chip's bandwidth.

The script first asks MLX how it reads ``grid`` (threads or blocks), checks the candidate against
the composition (``fused=False``) on cases with ties, NaN and -inf rows, out-of-vocabulary ids and
EOS sets, then times floor (``mx.max`` + read), the composition, the shipped kernel, the candidate
and the PyTorch peer (argmax, compare, cumprod, as vLLM does), interleaved, at V = 152064 and
N = 4, 8, 16, with a draft that agrees with the argmax for half its length.

Usage (where MLX runs on CUDA): ``python benchmarks/fused_greedy.py [--repeats R]``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import mlx.core as mx
import numpy as np

from mlx_spec import accept_greedy, fused, read
from mlx_spec.bench import time_cases

SLICE = 4096  # columns per block of the first launch
ROWS_SOURCE = r"""
// Block b: the argmax of row b / S over columns [s L, s L + L), L = ceil(V / S) rounded to 8.
// A NaN in the slice makes its maximum NaN (the decision reads it as an invalid row).
template <typename T>
__device__ void ms_slice_argmax(const T* logits, float* part_max, uint32_t* part_at, int R,
                                int V, int S) {
  __shared__ float s_best[8];
  __shared__ uint32_t s_at[8];
  const int b = blockIdx.x;
  if (b >= R * S) return;
  const int r = b / S, s = b % S, t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const int width = ((V + S - 1) / S + 7) / 8 * 8;
  const int lo = s * width, hi = min(V, lo + width);
  const T* row = logits + (size_t)r * V;
  float best = __int_as_float(0xFF800000);
  uint32_t at = 0xFFFFFFFFu;
  bool nan = false;
#pragma unroll 4
  for (int k = lo + t; k < hi; k += 256) {
    const float x = ms_float(row[k]);
    nan |= isnan(x);
    ms_keep_max(best, at, x, k);
  }
  for (int d = 16; d > 0; d >>= 1) {
    const float other = __shfl_down_sync(0xFFFFFFFFu, best, d);
    const uint32_t other_at = __shfl_down_sync(0xFFFFFFFFu, at, d);
    ms_keep_max(best, at, other, other_at);
  }
  if (lane == 0) { s_best[warp] = best; s_at[warp] = at; }
  nan = __syncthreads_or(nan);
  if (t == 0) {
    for (int w = 1; w < 8; ++w) ms_keep_max(best, at, s_best[w], s_at[w]);
    part_max[b] = nan ? __int_as_float(0x7FC00000) : best;
    part_at[b] = at;
  }
}
"""
DECIDE_SOURCE = r"""
// One warp: combine the S slices of row 0, 1, ... and decide with ms_greedy's own row step.
template <typename D, typename ET>
__device__ void ms_decide(const float* part_max, const uint32_t* part_at, const D* draft,
                          const ET* eos, uint32_t* out, int R, int S, int E) {
  if (!ms_first_block()) return;
  const int lane = threadIdx.x;
  uint32_t accepted = 0, token = 0;
  bool eos_in_draft = false;
  for (int r = 0; r < R; ++r) {
    float best = __int_as_float(0xFF800000);
    uint32_t at = 0xFFFFFFFFu;
    bool nan = false;
    for (int i = lane; i < S; i += 32) {
      const float x = part_max[r * S + i];
      nan |= isnan(x);
      ms_keep_max(best, at, x, part_at[r * S + i]);
    }
    for (int d = 16; d > 0; d >>= 1) {
      const float other = __shfl_down_sync(0xFFFFFFFFu, best, d);
      const uint32_t other_at = __shfl_down_sync(0xFFFFFFFFu, at, d);
      ms_keep_max(best, at, other, other_at);
    }
    const uint32_t choice = __shfl_sync(0xFFFFFFFFu, at, 0);
    nan = __any_sync(0xFFFFFFFFu, nan);
    if (!ms_greedy_row<D, ET>(r, R - 1, choice, nan, draft, eos, E, accepted, token,
                              eos_in_draft)) {
      break;
    }
  }
  if (lane == 0) ms_write<ET>(out, accepted, token, eos_in_draft, eos, E);
}
"""


def grid_counts_threads() -> bool:
    """Whether MLX's ``grid`` counts threads (as Metal's dispatchThreads) rather than blocks."""
    probe = mx.fast.cuda_kernel(
        name="mlx_spec_grid_probe",
        input_names=["x"],
        output_names=["out"],
        source="if (threadIdx.x == 0 && blockIdx.x == 0) { out[0] = gridDim.x; }",
    )
    out = probe(
        inputs=[mx.zeros((1,))],
        grid=(64, 1, 1),
        threadgroup=(32, 1, 1),
        output_shapes=[(1,)],
        output_dtypes=[mx.uint32],
    )[0]
    blocks = int(out.item())
    print(f"grid=(64, 1, 1), threadgroup=(32, 1, 1) launches {blocks} blocks")
    return blocks == 2


def two_launch_greedy(threads: bool) -> Callable[[mx.array, mx.array, mx.array], mx.array]:
    """The candidate: ``(logits, draft, eos) -> [3]`` uint32, as ``fused.greedy``."""
    rows = mx.fast.cuda_kernel(
        name="mlx_spec_greedy_slices",
        input_names=["logits"],
        output_names=["part_max", "part_at"],
        source=(
            "ms_slice_argmax<T>(logits, part_max, part_at, logits_shape[0], logits_shape[1], S);"
        ),
        header=fused._HEADER + ROWS_SOURCE,
    )
    decide = mx.fast.cuda_kernel(
        name="mlx_spec_greedy_decide",
        input_names=["part_max", "part_at", "draft", "eos"],
        output_names=["out"],
        source=(
            "ms_decide<D, ET>(part_max, part_at, draft, eos, out, part_max_shape[0], "
            "part_max_shape[1], eos_shape[0]);"
        ),
        header=fused._HEADER + DECIDE_SOURCE,
    )

    def greedy(logits: mx.array, draft: mx.array, eos: mx.array) -> mx.array:
        r, v = logits.shape
        s = -(-v // SLICE)
        part_max, part_at = rows(
            inputs=[logits],
            template=[("T", logits.dtype), ("S", s)],
            grid=(r * s * 256 if threads else r * s, 1, 1),
            threadgroup=(256, 1, 1),
            output_shapes=[(r, s), (r, s)],
            output_dtypes=[mx.float32, mx.uint32],
        )
        return decide(
            inputs=[part_max, part_at, draft, eos],
            template=[("D", draft.dtype), ("ET", eos.dtype)],
            grid=(32, 1, 1),
            threadgroup=(32, 1, 1),
            output_shapes=[(3,)],
            output_dtypes=[mx.uint32],
        )[0]

    return greedy


def check(candidate: Callable) -> int:
    """Compares the candidate with the composition; returns the number of cases."""
    rng = np.random.default_rng(0)
    cases = 0
    for n, v in [(0, 1), (1, 5), (4, 4099), (8, 152064), (16, 33)]:
        for dtype in (mx.float32, mx.bfloat16):
            for i in range(8):
                rows = rng.standard_normal((n + 1, v)).astype(np.float32) * [0.5, 3, 30][i % 3]
                if i % 4 == 1:
                    rows = np.round(rows)
                if i % 4 == 2:
                    rows[rng.integers(n + 1)] = -np.inf
                if i % 4 == 3:
                    rows[rng.integers(n + 1), rng.integers(v)] = np.nan
                logits = mx.array(rows).astype(dtype)
                choice = np.array(mx.argmax(logits.astype(mx.float32), axis=-1))
                agree = rng.integers(n + 1)
                draft = np.where(np.arange(n) < agree, choice[:n], (choice[:n] + 1) % v)
                if i == 5 and n:
                    draft[-1] = v
                d = mx.array(draft.astype(np.uint32)) if n else mx.array([0xFFFFFFFF], mx.uint32)
                eos = mx.array([int(choice[0]) if i % 2 else 0xFFFFFFFF], mx.uint32)
                want = np.array(accept_greedy(logits, mx.array(draft, mx.uint32), eos))
                got = np.array(candidate(logits, d, eos))
                assert got.tolist() == want.tolist(), (n, v, dtype, i, got, want)
                cases += 1
    return cases


def timed_cases(n: int, v: int, candidate: Callable) -> dict[str, Callable[[], object]]:
    """The verifications to time at draft length ``n``, on the same bfloat16 rows."""
    import torch

    rng = np.random.default_rng(n)
    rows = rng.standard_normal((n + 1, v)).astype(np.float32) * 4
    logits = mx.array(rows).astype(mx.bfloat16)
    choice = np.array(mx.argmax(logits, axis=-1))
    draft = mx.array(np.where(np.arange(n) < n // 2, choice[:n], (choice[:n] + 1) % v))
    draft = draft.astype(mx.uint32)
    no_eos = mx.array([0xFFFFFFFF], mx.uint32)
    mx.eval(logits, draft)
    t_logits = torch.from_numpy(rows).to("cuda", torch.bfloat16)
    t_draft = torch.from_numpy(np.array(draft).astype(np.int64)).to("cuda")

    def torch_greedy() -> list[int]:
        picks = t_logits.argmax(dim=-1)
        accepted = (picks[:n] == t_draft).to(torch.int32).cumprod(0).sum()
        return torch.stack([accepted, picks[accepted]]).tolist()

    return {
        "floor": lambda: mx.max(logits, axis=-1).tolist(),
        "composition": lambda: read(accept_greedy(logits, draft)),
        "one block": lambda: read(accept_greedy(logits, draft, fused=True)),
        "two launches": lambda: read(candidate(logits, draft, no_eos)),
        "torch": torch_greedy,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args(argv)
    if not fused.available():
        sys.exit("fused_greedy.py: needs MLX's CUDA backend (MLX runs on the CPU here)")
    candidate = two_launch_greedy(grid_counts_threads())
    print(f"candidate equals the composition on {check(candidate)} cases")
    v = 152064
    print(f"V={v}; medians of {args.repeats} interleaved repeats, ms, with the read")
    for n in (4, 8, 16):
        times = time_cases(timed_cases(n, v, candidate), args.repeats)
        line = "  ".join(f"{k} {t * 1e3:.3f}" for k, t in times.items())
        ratio = times["two launches"] / times["torch"]
        print(f"N={n:2d}  {line}  two launches / torch {ratio:.2f}x", flush=True)


if __name__ == "__main__":
    main()
