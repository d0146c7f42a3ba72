"""Generation as a caller sees it: ``stream_generate``, text segments and all, on the demo pair.

``benchmarks/generation.py`` times the token loops alone. A caller of ``stream_generate`` (the
``mlx-spec generate`` command, a chat loop) also detokenizes each token and handles its response.
mlx-lm's plain decoding starts each step before it yields the token before, so that work overlaps
the model's; this measures whether speculation keeps up once that work is in the loop. Methods,
each a full ``stream_generate`` whose responses the caller reads to the end:

- ``plain``: ``mlx_lm.stream_generate``;
- ``mlx-lm draft``: the same with the demo draft model, ``--num-draft-tokens`` (mlx-lm's loop);
- ``draft``, ``draft adaptive``, ``lookup adaptive``: ``mlx_spec.stream_generate`` with the draft
  model at that ``N`` or with adaptive lengths up to it, and with prompt lookup.

Greedy, interleaved prompt by prompt, ``--repeats`` passes after one untimed; prints the median
tokens a second of each method over a workload's prompts and its ratio to ``plain``.

Usage: ``python benchmarks/stream.py [--tokens 256] [--prompts 4] [--repeats 3]
[--num-draft-tokens 3]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("MLX_CUDA_USE_CUDNN_SDPA", "0")

import mlx.core as mx
import mlx_lm

import mlx_spec
from mlx_spec import bench
from mlx_spec.cli._common import integer
from mlx_spec.draft_length import MAX_DRAFT_TOKENS


def _methods(target: Any, draft: Any, n: int) -> dict[str, Callable[..., Any]]:
    def spec(**kwargs: Any) -> Callable[..., Any]:
        return lambda tokenizer, prompt, tokens: mlx_spec.stream_generate(
            target, tokenizer, prompt, tokens, **kwargs
        )

    return {
        "plain": lambda tokenizer, prompt, tokens: mlx_lm.stream_generate(
            target, tokenizer, prompt, tokens
        ),
        "mlx-lm draft": lambda tokenizer, prompt, tokens: mlx_lm.stream_generate(
            target, tokenizer, prompt, tokens, draft_model=draft, num_draft_tokens=n
        ),
        "draft": spec(draft_model=draft, num_draft_tokens=n),
        "draft adaptive": spec(draft_model=draft, num_draft_tokens=n, adaptive=True),
        "lookup adaptive": spec(drafter="prompt-lookup", num_draft_tokens=n, adaptive=True),
    }


def _rate(run: Callable[..., Any], tokenizer: Any, prompt: mx.array, tokens: int) -> float:
    """Tokens a second from the call to its last response, the text kept as a caller keeps it."""
    start = time.perf_counter()
    pieces = [response.text for response in run(tokenizer, prompt, tokens)]
    return len(pieces) / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=integer(1), default=256)
    parser.add_argument("--prompts", type=integer(1, 4), default=4)
    parser.add_argument("--repeats", type=integer(1), default=3)
    parser.add_argument("--num-draft-tokens", type=integer(1, MAX_DRAFT_TOKENS), default=3)
    args = parser.parse_args(argv)
    target, draft, tokenizer = bench.load_demo_pair()
    methods = _methods(target, draft, args.num_draft_tokens)
    print(
        f"# stream: {mx.default_device()}, MLX {mx.__version__}, mlx-lm {mlx_lm.__version__}, "
        f"N = {args.num_draft_tokens}, {args.prompts} prompts a workload x {args.tokens} tokens, "
        f"median of {args.repeats} interleaved passes; tokens/s (x plain: above 1 is faster "
        "than mlx-lm's plain decoding)"
    )
    ratios = " | ".join(f"x plain {m}" for m in methods)
    print(f"| workload | {' | '.join(methods)} | {ratios} |")
    print("|---" * (1 + 2 * len(methods)) + "|")
    for workload, prompts in bench.demo_workloads(tokenizer, args.prompts).items():
        rates: dict[str, list[float]] = {name: [] for name in methods}
        for repeat in range(args.repeats + 1):
            for prompt in prompts:
                for name, run in methods.items():
                    rate = _rate(run, tokenizer, prompt, args.tokens)
                    if repeat:
                        rates[name].append(rate)
        median = {name: statistics.median(r) for name, r in rates.items()}
        cells = [f"{median[m]:.1f}" for m in methods]
        cells += [f"{median[m] / median['plain']:.2f}x" for m in methods]
        print(f"| {workload} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
