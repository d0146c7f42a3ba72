"""How many kernels does one verification launch? Counted from MLX's graph, before evaluation.

On a GPU a verification costs kernel launches more than passes over memory, so the number of
primitives that run (after ``mx.compile`` has fused element-wise chains) is the cost to cut. Where
MLX runs on CUDA, the fused paths (``fused=True``: two ``CustomKernel`` launches for greedy, one
for sampled after its uniforms) are counted too. The graph is exported with ``mx.export_to_dot``
and its primitive nodes are counted; views that launch nothing (reshape, squeeze, broadcast,
slice, ...) are listed apart.

Usage: ``python benchmarks/kernels.py [--vocab V] [--draft N]``.
"""

from __future__ import annotations

import argparse
import io
import re
from collections import Counter

import mlx.core as mx

from mlx_spec import accept_greedy, accept_sampled, kernels

VIEWS = {"Reshape", "Squeeze", "ExpandDims", "Broadcast", "Slice", "Transpose", "AsStrided"}


def primitives(*outputs: mx.array) -> Counter:
    """Counts the primitive nodes of the graph that computes ``outputs``."""
    dot = io.StringIO()
    mx.export_to_dot(dot, *outputs)
    return Counter(re.findall(r'\[label ="([^"]+)", shape=rectangle\]', dot.getvalue()))


def kernel_counts(v: int, n: int) -> dict[str, tuple[int, int, Counter]]:
    """For each acceptance: (kernels, views, the kernels by primitive)."""
    logits = mx.random.normal((1, n + 8, v), key=mx.random.key(0)).astype(mx.bfloat16)
    rows = logits[0, -(n + 1) :]
    probs = mx.softmax(rows.astype(mx.float32), axis=-1)
    q = mx.softmax(mx.random.normal((n, v), key=mx.random.key(1)), axis=-1)
    draft = mx.argmax(q, axis=-1).astype(mx.uint32)
    eos = mx.array([2], mx.uint32)
    key = mx.random.key(2)
    mx.eval(rows, probs, q, draft)
    graphs = {
        "accept_greedy": accept_greedy(rows, draft),
        "accept_greedy eos": accept_greedy(rows, draft, eos),
        "accept_sampled q": accept_sampled(probs, draft, q, None, key),
        "accept_sampled none": accept_sampled(probs, draft, None, None, key),
        "accept_sampled q eos": accept_sampled(probs, draft, q, eos, key),
    }
    if kernels.available():
        graphs.update(
            {
                "fused greedy": accept_greedy(rows, draft, fused=True),
                "fused greedy eos": accept_greedy(rows, draft, eos, fused=True),
                "fused sampled q": accept_sampled(probs, draft, q, None, key, fused=True),
                "fused sampled none": accept_sampled(probs, draft, None, None, key, fused=True),
            }
        )
    counts = {}
    for name, out in graphs.items():
        prims = primitives(out)
        launched = Counter({k: c for k, c in prims.items() if k not in VIEWS})
        counts[name] = (
            sum(launched.values()),
            sum(prims.values()) - sum(launched.values()),
            launched,
        )
    return counts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=int, default=152064)
    parser.add_argument("--draft", type=int, default=8)
    args = parser.parse_args(argv)
    print(f"mlx {mx.__version__}, {mx.default_device()}, V={args.vocab}, N={args.draft}")
    print(f"{'graph':22} {'kernels':>7} {'views':>5}  kernels by primitive")
    for name, (launches, views, by) in kernel_counts(args.vocab, args.draft).items():
        detail = ", ".join(f"{k} {c}" for k, c in sorted(by.items()))
        print(f"{name:22} {launches:7d} {views:5d}  {detail}")


if __name__ == "__main__":
    main()
