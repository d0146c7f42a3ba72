"""What does an MTP draft step cost, against a step of the target and of the draft model?

An MTP draft step (:class:`mlx_spec.mtp.MTPHead`) runs the two norms, the projection, one decoder
layer of the target's kind and the target's LM head over one position. A target step runs the
whole target over one position; a draft model step, the pair's draft model (the first layer of
the random pairs' targets, the distilled 1 x 192 model of the demo pair). Each is timed as a
decoding step: one call after ``--context`` cached positions, evaluated, its cache trimmed back.
The three alternate within every repeat, so that load on the machine hits them alike, and the
table gives the median of ``--repeats`` repeats after two untimed ones.

The demo target's head is the one it ships; the random pairs' targets (``16x2048``, ``16x4096``:
see ``benchmarks/generation.py``) get a head of the right shape (Qwen's layout, one layer) with
random weights, since its cost does not depend on what it learned.

Usage: ``python benchmarks/mtp_cost.py [--pair demo 16x2048 16x4096] [--context C]
[--repeats R]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, make_prompt_cache

sys.path.insert(0, str(Path(__file__).resolve().parent))

from generation import build_pair

from mlx_spec import _mlx_lm, bench
from mlx_spec.mtp import MTPHead, head_of, new_head

UNTIMED = 2


def model_step(model: nn.Module, context: mx.array) -> Callable[[], None]:
    """One decoding step of ``model`` after ``context`` (``[C]`` ids), its caches trimmed back."""
    cache = make_prompt_cache(model)
    mx.eval(model(context[None], cache=cache))
    token = context[-1:][None]

    def step() -> None:
        mx.eval(model(token, cache=cache))
        for layer in cache:
            layer.trim(1)

    return step


def mtp_step(target: nn.Module, head: MTPHead, context: mx.array) -> Callable[[], None]:
    """One MTP draft step after ``context`` (the head's cache holding an entry for each position,
    from the target's hidden states), its cache trimmed back."""
    split = _mlx_lm.split(target)
    hidden = split.backbone(context[None], cache=make_prompt_cache(target))
    cache = KVCache()
    _, normed = head(hidden, split.embed(context[None]), 0, cache, "causal")
    mx.eval(normed)
    last, token = hidden[:, -1:], context[-1:][None]

    def step() -> None:
        _, normed = head(last, split.embed(token), 0, cache)
        mx.eval(split.head(normed))
        cache.trim(1)

    return step


def interleaved(steps: dict[str, Callable[[], None]], repeats: int) -> dict[str, float]:
    """Median seconds of each of ``steps``, timed in turn within every repeat."""
    seconds: dict[str, list[float]] = {name: [] for name in steps}
    for i in range(repeats + UNTIMED):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            if i >= UNTIMED:
                seconds[name].append(time.perf_counter() - start)
    return {name: statistics.median(times) for name, times in seconds.items()}


def main(argv: list[str] | None = None) -> list[dict[str, float | str]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pair", nargs="+", default=["demo", "16x2048", "16x4096"])
    parser.add_argument("--context", type=int, default=256, help="cached positions (default 256)")
    parser.add_argument("--repeats", type=int, default=200, help="timed repeats (default 200)")
    args = parser.parse_args(argv)
    m = bench.machine()
    print(
        f"# MTP step cost: {m['date']}, {m['system']}, MLX {m['mlx']} ({m['device']}); "
        f"{args.context} cached positions, median of {args.repeats} interleaved repeats\n"
    )
    print(
        "| pair | head | target step (ms) | MTP step (ms) | draft model step (ms) "
        "| MTP / target | draft model / target |"
    )
    print("|---|---|---|---|---|---|---|")
    rows = []
    for name in args.pair:
        pair = build_pair(name, 1)
        head = head_of(pair.target)
        kind = "shipped" if head is not None else "random"
        if head is None:
            head = new_head(pair.target, "qwen")
            mx.eval(head.parameters())
        vocab = pair.target.args.vocab_size
        context = mx.random.randint(1, vocab, (args.context,), key=mx.random.key(0))
        times = interleaved(
            {
                "target": model_step(pair.target, context),
                "mtp": mtp_step(pair.target, head, context),
                "draft": model_step(pair.draft, context),
            },
            args.repeats,
        )
        rows.append({"pair": name, "head": kind, **times})
        print(
            f"| {name} | {kind} | {times['target'] * 1e3:.3f} | {times['mtp'] * 1e3:.3f} | "
            f"{times['draft'] * 1e3:.3f} | {times['mtp'] / times['target']:.3f} | "
            f"{times['draft'] / times['target']:.3f} |",
            flush=True,
        )
    return rows


if __name__ == "__main__":
    main()
