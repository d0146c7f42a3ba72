"""How many draft tokens does coupled sampling keep, against the residual rule?

Coupled sampling (:mod:`mlx_spec.rules`, the default) keeps a draft model's token where the draft
model's draw and the target's, made with the same position's randomness, agree; the residual rule
(rejection sampling) keeps it with probability ``min(1, p / q)``, ``Σ min(p, q)`` on average. Both
give the target's distribution; coupled also gives plain sampling's text for a key. This prints,
for the demo pair's draft model at fixed ``N``, the tokens per round of each rule under several
samplers, averaged over the benchmark's prompts and several keys, and their ratio. Tokens per
round are counts, not times: they carry over from this CPU to any machine.

Usage: ``python benchmarks/coupling.py [--pair demo] [--drafts 2 4] [--prompts 4] [--keys 3]
[--tokens 128]``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from generation import WORKLOADS, build_pair

from mlx_spec.generation import SpeculativeStats, speculative_generate_step
from mlx_spec.sampling import make_sampler

SAMPLERS = {
    "t0.6": dict(temp=0.6),
    "t0.8": dict(temp=0.8),
    "t1": dict(temp=1.0),
    "t0.8 top-p 0.9": dict(temp=0.8, top_p=0.9),
    "t1 top-p 0.95": dict(temp=1.0, top_p=0.95),
    "t0.8 min-p 0.05": dict(temp=0.8, min_p=0.05),
}


def tokens_per_round(target, draft, prompt, sampler, n: int, key: int, acceptance: str, tokens):
    """The counts of one generation at a fixed ``N``."""
    stats = SpeculativeStats()
    for _ in speculative_generate_step(
        prompt,
        target,
        draft,
        num_draft_tokens=n,
        max_tokens=tokens,
        sampler=sampler,
        key=mx.random.key(key),
        stats=stats,
        acceptance=acceptance,
    ):
        pass
    return stats


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", default="demo")
    parser.add_argument("--drafts", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--keys", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--workload", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--samplers", nargs="+", choices=list(SAMPLERS), default=list(SAMPLERS))
    args = parser.parse_args(argv)
    pair = build_pair(args.pair, args.prompts)
    print(
        f"# pair {args.pair}, draft model, {args.tokens} tokens, {args.keys} keys x "
        f"{args.prompts} prompts a workload"
    )
    print(
        "| workload | sampler | N | residual tok/round | coupled tok/round | coupled / residual |"
    )
    print("|---|---|---|---|---|---|")
    for workload in args.workload:
        for name in args.samplers:
            sampler = make_sampler(**SAMPLERS[name])
            for n in args.drafts:
                means = {}
                for acceptance in ("residual", "coupled"):
                    runs = [
                        tokens_per_round(
                            pair.target,
                            pair.draft,
                            prompt,
                            sampler,
                            n,
                            key,
                            acceptance,
                            args.tokens,
                        )
                        for prompt in pair.workloads[workload]
                        for key in range(args.keys)
                    ]
                    means[acceptance] = float(np.mean([s.tokens_per_round for s in runs]))
                print(
                    f"| {workload} | {name} | {n} | {means['residual']:.2f} "
                    f"| {means['coupled']:.2f} | {means['coupled'] / means['residual']:.2f}x |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
