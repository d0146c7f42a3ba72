"""What does a sampled generation cost the first time it meets a temperature, top-p or min-p?

A server answers requests whose sampler values vary, and MLX compiles the kernels of a compiled
graph anew for every constant written into it: a ``g++`` run per kernel on MLX's CPU backend, a
JIT compile on Metal and CUDA. This script runs short sampled generations of the demo target
(prompt lookup, ``--tokens`` tokens, a coupled draw each round and plain step) at ``--values``
sets of sampler values in turn, each set new to the process, and times each generation twice:
the first time it meets its values, and again at the same values. The kernel cache starts empty
(a new temporary folder), so the first generation of the run also pays for the graphs every set
shares; it is shown apart. mlx-lm's own sampled decoding (``generate_step``) is timed the same
way for comparison.

Usage: ``python benchmarks/new_sampler_values.py [--values 6] [--tokens 16]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable

# Before MLX compiles anything: its CPU kernels go to a folder of their own, empty.
os.environ["TMPDIR"] = tempfile.mkdtemp(prefix="mlx-kernels-")

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler as mlx_lm_sampler

from mlx_spec import bench, make_sampler, speculative_generate_step
from mlx_spec._demo import PROMPTS


def values(count: int) -> list[dict[str, float]]:
    """``count`` sets of sampler values with the same filters (top-p and min-p on), none equal."""
    return [
        {
            "temp": round(0.6 + 0.05 * i, 2),
            "top_p": round(0.9 + 0.01 * i, 2),
            "min_p": 0.02 + i / 1000,
        }
        for i in range(count)
    ]


def seconds(run: Callable[[dict[str, float]], None], options: dict[str, float]) -> float:
    """Seconds of ``run(options)``."""
    start = time.perf_counter()
    run(options)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> list[dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--values", type=int, default=6, help="sets of sampler values, 1 to 10")
    parser.add_argument("--tokens", type=int, default=16, help="tokens a generation")
    args = parser.parse_args(argv)
    if not 1 <= args.values <= 10:
        parser.error(f"--values must be 1 to 10 (top-p stays below 1), got {args.values}")
    if args.tokens < 1:
        parser.error(f"--tokens must be at least 1, got {args.tokens}")
    target, _, tokenizer = bench.load_demo_pair()
    prompt = mx.array(tokenizer.encode(PROMPTS[0]))

    def ours(options: dict[str, float]) -> None:
        sampler = make_sampler(**options)
        steps = speculative_generate_step(
            prompt, target, drafter="prompt-lookup", sampler=sampler, max_tokens=args.tokens
        )
        for _ in steps:
            pass

    def theirs(options: dict[str, float]) -> None:
        sampler = mlx_lm_sampler(**options)
        for _ in generate_step(prompt, target, sampler=sampler, max_tokens=args.tokens):
            pass

    m = bench.machine()
    print(
        f"# new sampler values: {m['date']}, {m['system']}, {m['cpu_count']} cores, MLX "
        f"{m['mlx']} ({m['device']}); the demo target, {args.tokens} tokens a generation, an "
        f"empty kernel cache at the start; ms a generation\n"
    )
    print("| values | mlx-spec first | mlx-spec again | mlx-lm first | mlx-lm again |")
    print("|---|---|---|---|---|")
    rows = []
    for options in values(args.values):
        row = {
            "ours_first": seconds(ours, options),
            "ours_again": seconds(ours, options),
        }
        row |= {
            "lm_first": seconds(theirs, options),
            "lm_again": seconds(theirs, options),
        }
        rows.append(row)
        name = ", ".join(f"{k} {v:g}" for k, v in options.items())
        cells = " | ".join(
            f"{row[k] * 1e3:.0f}" for k in ("ours_first", "ours_again", "lm_first", "lm_again")
        )
        print(f"| {name} | {cells} |", flush=True)
    later = rows[1:]
    if later:
        extra = [(r["ours_first"] - r["ours_again"]) * 1e3 for r in later]
        lm_extra = [(r["lm_first"] - r["lm_again"]) * 1e3 for r in later]
        print(
            f"\nA new set of values after the first costs mlx-spec "
            f"{statistics.median(extra):.0f} ms more than a generation at values it met "
            f"(median), mlx-lm "
            f"{statistics.median(lm_extra):.0f} ms."
        )
    return rows


if __name__ == "__main__":
    main()
