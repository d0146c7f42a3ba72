"""Which greedy kernel? The shipped two-launch kernel against three alternatives, on CUDA.

The shipped kernel (``mlx_spec.kernels``, ``accept_greedy(..., fused=True)``, its launches built
inside ``mx.compile``) takes the argmax of 4096-column slices of every row in its first launch
(many blocks: all ``N + 1`` rows at the bandwidth of the whole chip), then combines the slices and
decides in a second, one-block launch. The alternatives are timed as plain calls, beside the same
two launches uncompiled (``two launches, plain``):

- ``one block``, shipped before: one 1024-thread block reads row 0, 1, ... and stops at the first
  mismatch. It reads only ``accepted + 1`` rows, but at the bandwidth of one multiprocessor.
- ``last block``, one launch: the blocks of the first launch take a ticket from an atomic counter
  and the last to finish decides. MLX must first zero the counter (``init_value``, a fill before
  the kernel), so the GPU still runs two.
- ``ring``, one launch without the fill: 1024 counters zeroed once, each call takes the next, and
  the launch's last block zeroes it again. It is not shipped: under a caller's ``mx.compile`` the
  counter becomes a constant, so two verifications evaluated together could share it and decide
  wrongly. (A counter made on the host for each call instead lives in managed memory, where the
  blocks' atomics are slow.)

What each measured, and when, is in ``docs/performance.md``.

The script first asks MLX how it reads ``grid`` (threads or blocks; the kernels assume threads and
stay right either way), checks the kernels against the composition (``fused=False``) on the cases
of ``tests/test_fused.py``, then times floor (``mx.max`` + read), the composition, the kernels and
the PyTorch peer (argmax, compare, cumprod, as vLLM does), interleaved, at V = 152064 and
N = 4, 8, 16, with drafts that agree with the argmax for none, half and all of their length.

Usage (where MLX runs on CUDA): ``python benchmarks/fused_greedy.py [--repeats R]``.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlx_spec import accept_greedy, kernels, read

from _common import time_cases, torch_greedy_peers

# The alternatives' CUDA (device functions), compiled after the shipped greedy header.
ALTERNATIVES = (Path(__file__).parent / "fused_greedy.cuh").read_text(encoding="utf-8")


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


def _alternative(name: str, output: str, call: str) -> Callable[..., list]:
    """A kernel of inputs ``logits``, ``draft``, ``eos`` and one ``output``, whose body is
    ``call``, over the shipped header and the alternatives."""
    return mx.fast.cuda_kernel(
        name=f"mlx_spec_greedy_{name}",
        input_names=["logits", "draft", "eos"],
        output_names=[output],
        source=call,
        header=kernels.header("greedy") + ALTERNATIVES,
        ensure_row_contiguous=True,
    )


def one_block_greedy() -> Callable[[mx.array, mx.array, mx.array], mx.array]:
    """The alternative: ``(logits, draft, eos) -> [3]`` uint32, as ``kernels.greedy``."""
    kernel = _alternative(
        "one_block",
        "out",
        "ms_greedy<T, D, ET>(logits, draft, eos, out, logits_shape[0] - 1, logits_shape[1], "
        "eos_shape[0]);",
    )

    def greedy(logits: mx.array, draft: mx.array, eos: mx.array) -> mx.array:
        return kernel(
            inputs=[logits, draft, eos],
            template=[("T", logits.dtype), ("D", draft.dtype), ("ET", eos.dtype)],
            grid=(kernels.THREADS, 1, 1),
            threadgroup=(kernels.THREADS, 1, 1),
            output_shapes=[(3,)],
            output_dtypes=[mx.uint32],
        )[0]

    return greedy


def last_block_greedy() -> Callable[[mx.array, mx.array, mx.array], mx.array]:
    """The alternative in one launch: ``(logits, draft, eos) -> [3]`` uint32, as
    ``kernels.greedy``."""
    # `work`: [4 + 2 R S] uint32, the result, the counter (zeroed by MLX), then the slices' maxima
    # (as float bits) and their indices.
    kernel = _alternative(
        "last_block",
        "work",
        "const int S = (logits_shape[1] + MS_SLICE - 1) / MS_SLICE; "
        "uint32_t* parts = work + 4; "
        "ms_greedy_one_launch<T, D, ET>(logits, draft, eos, work + 3, work, "
        "reinterpret_cast<float*>(parts), parts + (size_t)logits_shape[0] * S, logits_shape[0], "
        "logits_shape[1], eos_shape[0]);",
    )

    def greedy(logits: mx.array, draft: mx.array, eos: mx.array) -> mx.array:
        rows, vocab = logits.shape
        slices = -(-vocab // kernels.SLICE)
        return kernel(
            inputs=[logits, draft, eos],
            template=[("T", logits.dtype), ("D", draft.dtype), ("ET", eos.dtype)],
            grid=(rows * slices * kernels.SLICE_THREADS, 1, 1),
            threadgroup=(kernels.SLICE_THREADS, 1, 1),
            output_shapes=[(4 + 2 * rows * slices,)],
            output_dtypes=[mx.uint32],
            init_value=0,
        )[0][:3]

    return greedy


def ring_greedy() -> Callable[[mx.array, mx.array, mx.array], mx.array]:
    """The alternative in one launch without a fill: ``(logits, draft, eos) -> [3]`` uint32, as
    ``kernels.greedy``, each call on the next of 1024 counters (not safe under ``mx.compile``)."""
    kernel = mx.fast.cuda_kernel(
        name="mlx_spec_greedy_ring",
        input_names=["logits", "draft", "eos", "counter"],
        output_names=["out", "part_max", "part_at"],
        source="ms_greedy_one_launch<T, D, ET>(logits, draft, eos, const_cast<uint32_t*>(counter), "
        "out, part_max, part_at, logits_shape[0], logits_shape[1], eos_shape[0]);",
        header=kernels.header("greedy") + ALTERNATIVES,
        ensure_row_contiguous=True,
    )
    ring = mx.zeros((1024,), mx.uint32)
    mx.eval(ring)
    taken = itertools.count()

    def greedy(logits: mx.array, draft: mx.array, eos: mx.array) -> mx.array:
        rows, vocab = logits.shape
        slices = -(-vocab // kernels.SLICE)
        slot = next(taken) % ring.shape[0]
        return kernel(
            inputs=[logits, draft, eos, ring[slot : slot + 1]],
            template=[("T", logits.dtype), ("D", draft.dtype), ("ET", eos.dtype)],
            grid=(rows * slices * kernels.SLICE_THREADS, 1, 1),
            threadgroup=(kernels.SLICE_THREADS, 1, 1),
            output_shapes=[(3,), (rows, slices), (rows, slices)],
            output_dtypes=[mx.uint32, mx.float32, mx.uint32],
        )[0]

    return greedy


def check(kernel: Callable) -> int:
    """Compares ``kernel`` with the composition on the cases of ``tests/test_fused.py`` (every
    dtype, ties, NaN and -inf rows, out-of-vocabulary and negative ids, EOS sets); returns their
    number."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from test_fused import GREEDY_SHAPES, greedy_inputs

    cases = 0
    for dtype in (mx.float32, mx.float16, mx.bfloat16):
        for n, v in GREEDY_SHAPES:
            for logits, draft, eos in greedy_inputs(n, v, dtype, seed=n * 1000 + v):
                want = np.array(accept_greedy(logits, draft, eos))
                no_id = kernels.no_id()
                got = np.array(kernel(logits, draft if n else no_id, no_id if eos is None else eos))
                assert got.tolist() == want.tolist(), (n, v, dtype, got, want)
                cases += 1
    return cases


def timed_cases(
    n: int, v: int, agree: int, alternatives: dict[str, Callable]
) -> dict[str, Callable]:
    """The verifications to time at draft length ``n``, on the same bfloat16 rows, with a draft
    that agrees with the argmax for its first ``agree`` tokens (PyTorch's where it sees the GPU)."""
    rng = np.random.default_rng(n)
    rows = rng.standard_normal((n + 1, v)).astype(np.float32) * 4
    logits = mx.array(rows).astype(mx.bfloat16)
    choice = np.array(mx.argmax(logits, axis=-1))
    draft = mx.array(np.where(np.arange(n) < agree, choice[:n], (choice[:n] + 1) % v))
    draft = draft.astype(mx.uint32)
    mx.eval(logits, draft)
    cases = {
        "floor": lambda: mx.max(logits, axis=-1).tolist(),
        "composition": lambda: read(accept_greedy(logits, draft)),
        "two launches": lambda: read(accept_greedy(logits, draft, fused=True)),
        "two launches, plain": lambda: read(kernels.greedy(logits, draft, kernels.no_id())),
    }
    for name, kernel in alternatives.items():
        cases[name] = lambda kernel=kernel: read(kernel(logits, draft, kernels.no_id()))
    peers = torch_greedy_peers(rows, np.array(draft))
    if peers:
        cases["torch"] = peers["torch greedy"]
    return cases


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args(argv)
    if not kernels.available():
        sys.exit("fused_greedy.py: needs MLX's CUDA backend (MLX runs on the CPU here)")
    grid_counts_threads()
    alternatives = {
        "one block": one_block_greedy(),
        "last block": last_block_greedy(),
        "ring": ring_greedy(),
    }
    for name, kernel in {"two launches": kernels.greedy, **alternatives}.items():
        print(f"{name} equals the composition on {check(kernel)} cases", flush=True)
    v = 152064
    print(f"V={v}; medians of {args.repeats} interleaved repeats, ms, with the read")
    for n in (4, 8, 16):
        for agree in (0, n // 2, n):
            times = time_cases(timed_cases(n, v, agree, alternatives), args.repeats)
            line = "  ".join(f"{k} {t * 1e3:.3f}" for k, t in times.items())
            if "torch" in times:
                line += f"  two launches / torch {times['two launches'] / times['torch']:.2f}x"
            print(f"N={n:2d} agree={agree:2d}  {line}", flush=True)


if __name__ == "__main__":
    main()
