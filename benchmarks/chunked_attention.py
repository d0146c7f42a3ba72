"""Verifications with their attention in chunks of queries against in one call.

On MLX's CUDA backend ``speculative_generate_step`` runs a verification's attention in chunks of
at most ``mlx_spec.attention.QUERIES_PER_CALL`` queries, which MLX's vector kernel takes; over more
queries MLX falls back to separate operations (``mlx_spec.attention`` says why). This measures
what that choice is worth, on any backend, both ways:

- the target's forward pass over ``q`` new tokens at a new cache length each call, synchronous,
  with the attention whole and in chunks (milliseconds, median of 12 calls);
- generation, interleaved prompt by prompt: mlx-lm's plain decoding and each speculative method
  with verifications whole and chunked; the steady state (each run twice, the second timed),
  median of ``--repeats``.

Prints two Markdown tables per pair. ``whole / chunked`` above 1: chunks are faster. The last
column says whether both ways gave the same tokens (the same keys when sampling): chunked and whole
attention round differently, and a random-weight model has near ties.

Usage: ``python benchmarks/chunked_attention.py [--pair demo 16x2048] [--temps 0 1]
[--tokens 128] [--repeats 3]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any
from unittest import mock

os.environ.setdefault("MLX_CUDA_USE_CUDNN_SDPA", "0")

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler as lm_make_sampler

sys.path.insert(0, str(Path(__file__).resolve().parent))

from generation import build_pair

from mlx_spec import generation
from mlx_spec.attention import chunking
from mlx_spec.sampling import make_sampler

QUERIES = (1, 3, 4, 5, 9)


def forward_ms(target: nn.Module, prompt: mx.array, queries: int, chunked: bool) -> float:
    """Milliseconds of one synchronous forward pass over ``queries`` new tokens, each call at a
    cache one token longer (as rounds meet them), median of 12 after 4 warm-up calls."""
    cache = make_prompt_cache(target)
    mx.eval(target(prompt[None], cache=cache))
    times = []
    for i in range(16):
        tokens = mx.array([[(7 * i + j) % 1000 + 1 for j in range(queries)]])
        start = time.perf_counter()
        with chunking() if chunked else nullcontext():
            mx.eval(target(tokens, cache=cache))
        times.append(time.perf_counter() - start)
        for layer in cache:
            layer.trim(queries - 1)
    return 1e3 * statistics.median(times[4:])


def _methods(name: str, pair: Any) -> dict[str, dict[str, Any]]:
    """The speculative methods of ``pair`` (keyword arguments of ``speculative_generate_step``)."""
    if name == "demo":
        return {
            "lookup N=8": {"drafter": "prompt-lookup", "num_draft_tokens": 8},
            "lookup adaptive": {
                "drafter": "prompt-lookup",
                "num_draft_tokens": 8,
                "adaptive": True,
            },
            "draft N=4": {"draft_model": pair.draft, "num_draft_tokens": 4},
        }
    return {
        "draft N=4": {"draft_model": pair.draft, "num_draft_tokens": 4},
        "draft N=8": {"draft_model": pair.draft, "num_draft_tokens": 8},
        "draft adaptive": {"draft_model": pair.draft, "num_draft_tokens": 8, "adaptive": True},
    }


def generation_rows(
    name: str, pair: Any, temp: float, tokens: int, repeats: int
) -> list[tuple[str, float, float, float, bool]]:
    """``(method, plain ms, whole ms, chunked ms, same tokens)`` a token, steady state."""
    workload = "input-grounded" if name == "demo" else "open"
    prompts = pair.workloads[workload]
    outputs: dict[tuple[str, bool, int], list[int]] = {}

    def plain(prompt: mx.array) -> Callable[[], None]:
        def go() -> None:
            sampler = lm_make_sampler(temp=temp)
            for _ in generate_step(prompt, pair.target, max_tokens=tokens, sampler=sampler):
                pass

        return go

    def speculative(prompt: mx.array, i: int, label: str, chunked: bool, **kwargs: Any):
        def go() -> None:
            # Chunked or whole whatever the backend chooses.
            with mock.patch.object(generation, "chunks_pay", lambda device: chunked):
                steps = generation.speculative_generate_step(
                    prompt,
                    pair.target,
                    max_tokens=tokens,
                    sampler=make_sampler(temp=temp),
                    key=mx.random.key(i),
                    **kwargs,
                )
                outputs[label, chunked, i] = [token for token, *_ in steps]

        return go

    runs: dict[tuple[str, bool | None], list[Callable[[], None]]] = {}
    for i, prompt in enumerate(prompts):
        runs.setdefault(("plain", None), []).append(plain(prompt))
        for label, kwargs in _methods(name, pair).items():
            for chunked in (False, True):
                runs.setdefault((label, chunked), []).append(
                    speculative(prompt, i, label, chunked, **kwargs)
                )
    seconds: dict[tuple[str, bool | None], list[list[float]]] = {
        method: [[] for _ in prompts] for method in runs
    }
    for _ in range(repeats):
        for i in range(len(prompts)):
            for method, goes in runs.items():
                goes[i]()  # the first use of this prompt and method, untimed
                start = time.perf_counter()
                goes[i]()
                seconds[method][i].append(time.perf_counter() - start)
    ms = {
        method: 1e3 * sum(statistics.median(s) for s in per) / (tokens * len(prompts))
        for method, per in seconds.items()
    }
    return [
        (
            label,
            ms["plain", None],
            ms[label, False],
            ms[label, True],
            all(outputs[label, False, i] == outputs[label, True, i] for i in range(len(prompts))),
        )
        for label in _methods(name, pair)
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pair", nargs="+", default=["demo", "16x2048"])
    parser.add_argument("--temps", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    for name in args.pair:
        pair = build_pair(name, 2)
        prompt = pair.workloads["open"][0]
        print(f"\n*chunked attention: {name} pair, {mx.default_device()}, MLX {mx.__version__}*")
        print("| forward over q tokens | " + " | ".join(f"q={q}" for q in QUERIES) + " |")
        print("|---|" + "---|" * len(QUERIES))
        for chunked in (False, True):
            cells = [f"{forward_ms(pair.target, prompt, q, chunked):.2f}" for q in QUERIES]
            print(f"| {'chunked' if chunked else 'whole'} (ms) | " + " | ".join(cells) + " |")
        print()
        print(
            "| temp | method | plain ms/token | whole ms/token | chunked ms/token | "
            "whole x plain | chunked x plain | whole / chunked | same tokens |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for temp in args.temps:
            for label, plain, whole, chunked, same in generation_rows(
                name, pair, temp, args.tokens, args.repeats
            ):
                print(
                    f"| {temp} | {label} | {plain:.3f} | {whole:.3f} | {chunked:.3f} | "
                    f"{plain / whole:.2f}x | {plain / chunked:.2f}x | {whole / chunked:.2f}x | "
                    f"{'yes' if same else 'no'} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
