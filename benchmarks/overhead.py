"""Where does a verification's time go on a GPU? MLX's cost per evaluation, apart from the work.

At V = 152064 and N + 1 bfloat16 rows (N = 16 by default), the median (and 90th percentile) of:

- mlx eval: ``mx.eval`` of ``a + 1`` for a ``[3]`` uint32 ``a``: one launch and the wait, no read;
- mlx tiny: the same + ``tolist``: the least that one evaluation with a read costs;
- mlx floor: ``mx.max`` over the rows + ``tolist`` (the floor of ``benchmarks/acceptance.py``);
- fused greedy: ``accept_greedy(..., fused=True)`` + ``read``, without EOS ids (where MLX runs
  on CUDA);
- fused greedy eos: the same with one EOS id, in an array made once as the generation loop's;
- fused plain: the two launches built anew (``kernels.greedy``, not compiled) + ``read``;
- fused numpy read: ``accept_greedy(..., fused=True)`` read through a NumPy copy, as ``read``
  read a ``[3]`` result before it took ``tolist``;
- torch tiny, torch floor, torch greedy: the same in PyTorch on the same GPU (vLLM's way), where
  PyTorch sees a CUDA GPU.

Each case is timed four ways in one run: alone (its runs in a row) before PyTorch initialises
CUDA in the process; alone after; interleaved with the cases above; and interleaved also with every
case of ``benchmarks/acceptance.py`` (the composition, mlx-lm's path, the sampled peers), as that
benchmark times them. Where the interleaved times exceed the lone ones, a case pays for the others.

First, the host time of building each step's graph without evaluating it (median of 2000 builds):
``mx.max``, ``accept_greedy(..., fused=True)`` (compiled: a replay) and ``kernels.greedy`` (both
launches built anew).

Usage: ``python benchmarks/overhead.py [--drafts N ...] [--repeats R]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import mlx.core as mx
import numpy as np

from mlx_spec import accept_greedy, kernels, read

from _common import acceptance_cases, time_cases, torch_greedy_peers

V = 152064


def _mlx_cases(n: int) -> tuple[dict[str, Callable[[], object]], np.ndarray, np.ndarray]:
    """The MLX cases at draft length ``n``, and their rows and draft for the PyTorch cases."""
    rng = np.random.default_rng(n)
    rows_np = rng.standard_normal((n + 1, V), dtype=np.float32) * 4
    rows = mx.array(rows_np).astype(mx.bfloat16)
    draft = mx.argmax(rows[:n], axis=-1).astype(mx.uint32)
    draft = mx.where(mx.arange(n) < n // 2, draft, (draft + 1) % V)
    tiny = mx.array([1, 2, 3], mx.uint32)
    eos = mx.array([V - 1], mx.uint32)
    mx.eval(rows, draft, tiny, eos)
    cases: dict[str, Callable[[], object]] = {
        "mlx eval": lambda: mx.eval(tiny + 1),
        "mlx tiny": lambda: (tiny + 1).tolist(),
        "mlx floor": lambda: mx.max(rows, axis=-1).tolist(),
    }
    if kernels.available():
        cases["fused greedy"] = lambda: read(accept_greedy(rows, draft, fused=True))
        cases["fused greedy eos"] = lambda: read(accept_greedy(rows, draft, eos, fused=True))
        cases["fused plain"] = lambda: read(kernels.greedy(rows, draft, kernels.no_id()))
        cases["fused numpy read"] = lambda: np.array(accept_greedy(rows, draft, fused=True))
    return cases, rows_np, np.array(draft)


def _build_times(n: int, builds: int = 2000) -> dict[str, float]:
    """Host seconds to build (not evaluate) each step's graph at draft length ``n``."""
    rows = mx.zeros((n + 1, V), mx.bfloat16)
    draft = mx.zeros((n,), mx.uint32)
    mx.eval(rows, draft)
    steps: dict[str, Callable[[], object]] = {"mx.max": lambda: mx.max(rows, axis=-1)}
    if kernels.available():
        steps["accept_greedy fused"] = lambda: accept_greedy(rows, draft, fused=True)
        steps["kernels.greedy"] = lambda: kernels.greedy(rows, draft, kernels.no_id())
    times = {}
    for name, build in steps.items():
        build()
        samples = []
        for _ in range(builds):
            start = time.perf_counter()
            build()
            samples.append(time.perf_counter() - start)
        times[name] = statistics.median(samples)
    return times


def _torch_cases(rows_np: np.ndarray, draft_np: np.ndarray) -> dict[str, Callable[[], object]]:
    """The PyTorch cases on the same rows (this starts CUDA in PyTorch), or ``{}``."""
    peers = torch_greedy_peers(rows_np, draft_np)
    if not peers:
        return {}
    import torch

    tiny = torch.tensor([1, 2, 3], device="cuda")
    return {"torch tiny": lambda: (tiny + 1).tolist(), **peers}


def _alone(cases: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """Each case's runs in a row, after two warm-up runs: seconds."""
    samples = {}
    for name, fn in cases.items():
        fn()
        fn()
        samples[name] = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return samples


def _cell(samples: list[float] | float | None) -> str:
    if samples is None:
        return f"{'-':>15}"
    if isinstance(samples, float):
        return f"{samples * 1e3:15.3f}"
    p90 = statistics.quantiles(samples, n=10)[-1]
    return f"{statistics.median(samples) * 1e3:7.3f} ({p90 * 1e3:5.3f})"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--drafts", type=int, nargs="+", default=[16], help="draft lengths N")
    parser.add_argument("--repeats", type=int, default=300, help="runs per case and way")
    args = parser.parse_args(argv)
    print(
        f"mlx {mx.__version__}, device {mx.default_device()}, V = {V}, bfloat16; ms, median "
        f"(90th percentile) of {args.repeats} runs; interleaved, among all: median",
        flush=True,
    )
    for n in args.drafts:
        built = _build_times(n)
        mlx_cases, rows_np, draft_np = _mlx_cases(n)
        before = _alone(mlx_cases, args.repeats)
        torch_cases = _torch_cases(rows_np, draft_np)
        after = _alone({**mlx_cases, **torch_cases}, args.repeats)
        mixed = time_cases({**mlx_cases, **torch_cases}, args.repeats)
        among_all = time_cases({**acceptance_cases(V, n), **mlx_cases, **torch_cases}, args.repeats)
        print(f"\nN = {n}")
        print("building the graph: " + ", ".join(f"{k} {t * 1e6:.1f} us" for k, t in built.items()))
        print(
            f"{'case':<17} {'alone, no torch':>15} {'alone':>15} {'interleaved':>15} "
            f"{'among all':>15}"
        )
        for name in mixed:
            print(
                f"{name:<17} {_cell(before.get(name))} {_cell(after[name])} "
                f"{_cell(mixed[name])} {_cell(among_all[name])}"
            )


if __name__ == "__main__":
    main()
