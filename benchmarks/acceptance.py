"""How fast is one verification step? Acceptance + read against its floor and its peers.

For each vocabulary size V and draft length N, on bfloat16 logits and float32 probabilities, the
median latency (interleaved repeats, one run) of:

- floor: ``mx.max`` over the same rows + a read (bfloat16 logits for greedy, float32 probs for
  sampled): no acceptance can read its rows faster;
- mlx-spec: ``accept_greedy`` / ``accept_sampled`` (with and without ``draft_probs``) + ``read``;
- mlx-lm: its verification path today (log-softmax and sampler over the N + 1 rows, ``tolist``,
  compare in Python, as ``mlx_lm.generate.speculative_generate_step`` does);
- nan check: what reporting a NaN row costs in ``accept_greedy`` (a gather of one value per row
  at its argmax, and ``isnan``), + a read, beside the floor's pass over the rows;
- oracle: the plain-loop NumPy oracle of the test suite (with ``--oracle``; it is slow);
- torch: where PyTorch sees a CUDA GPU and MLX runs on the GPU, the same acceptance written the
  way vLLM's rejection sampler does it (argmax, compare, cumprod; ratio test, residual,
  exponential-race sampling), on the same GPU;
- fused: where MLX runs on CUDA, mlx-spec's fused kernels (``fused=True``: greedy two launches,
  sampled one after the uniforms).

The cases and their timing live in ``benchmarks/_common.py`` (``overhead.py`` and
``fused_greedy.py`` time them too); this script adds the oracle.

Usage: ``python benchmarks/acceptance.py [--quick] [--vocabs V ...] [--drafts N ...] [--repeats R]
[--oracle] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

from _common import DRAFTS, VOCABS, acceptance_rows, acceptance_table


def _add_oracle(v: int, n: int, cases: dict) -> None:
    """Adds ``oracle greedy``, the test suite's NumPy oracle on the same rows."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from oracle import oracle_greedy

    rng = np.random.default_rng(v + n)
    rows = (rng.standard_normal((n + 1, v), dtype=np.float32) * 4).astype(np.float32)
    rows = np.array(mx.array(rows).astype(mx.bfloat16).astype(mx.float32))
    draft = rows[:n].argmax(-1).astype(np.uint32)
    draft = np.where(np.arange(n) < n // 2, draft, (draft + 1) % v).astype(np.uint32)
    cases["oracle greedy"] = lambda: oracle_greedy(rows, draft, [])


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="V = 152064 and N = 8 only")
    parser.add_argument("--vocabs", type=int, nargs="+", help=f"vocabulary sizes ({VOCABS})")
    parser.add_argument("--drafts", type=int, nargs="+", help=f"draft lengths ({DRAFTS})")
    parser.add_argument("--repeats", type=int, default=25, help="interleaved repeats per case")
    parser.add_argument("--oracle", action="store_true", help="also time the NumPy oracle")
    parser.add_argument("--json", type=Path, help="write the raw medians (seconds) here")
    args = parser.parse_args(argv)
    vocabs, drafts = args.vocabs or VOCABS, args.drafts or DRAFTS
    configs = [(152064, 8)] if args.quick else [(v, n) for v in vocabs for n in drafts]
    print(
        f"mlx {mx.__version__}, device {mx.default_device()}, {platform.machine()} "
        f"{platform.system()}; medians of {args.repeats} interleaved repeats; times in ms; "
        "'x floor' = time / floor, 'speedup' = mlx-lm / mlx-spec",
        flush=True,
    )
    rows = acceptance_rows(
        configs,
        args.repeats,
        lambda label: print(f"[{label}] ...", file=sys.stderr, flush=True),
        _add_oracle if args.oracle else None,
    )
    print(acceptance_table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
