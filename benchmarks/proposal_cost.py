"""What does a prompt-lookup proposal cost, against a round of the demo target, as the text grows?

One round of prompt lookup costs ``PromptLookupDrafter.propose`` and, once the round is decided,
``update``, which indexes the tokens the round added (time in those tokens, not in the length of
the text). The text is the standard library's own Python source in the demo tokenizer's tokens:
the prompt is its first ``L`` tokens (indexed once by ``start``), and each round appends what
followed in the source (the draft tokens that agree with it and one more), as a generation that
copies text would. The median of ``--rounds`` rounds' ``propose`` + ``update`` is set against the
median time of a round of the demo target at a cache of 1,000 tokens: one call over ``N + 1``
positions, ``accept_greedy`` and the read. At a longer context a round of the target costs more
(its attention reads every cached position), so the ratio at 100,000 tokens, taken against the
round at 1,000, is an upper bound.

Usage: ``python benchmarks/proposal_cost.py [--contexts 1000 100000] [--drafts 1 8] [--rounds R]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from mlx_spec import accept_greedy, bench, read
from mlx_spec.drafters import DraftSetup, PromptLookupDrafter
from mlx_spec.loop import Text
from mlx_spec.rules import make_rule

ROUND_CONTEXT = 1000


def corpus(tokenizer: Any, length: int) -> list[int]:
    """At least ``length`` tokens of the standard library's source, file by file in name order."""
    ids: list[int] = []
    for path in sorted(Path(os.__file__).parent.glob("*.py")):
        ids += tokenizer.encode(path.read_text(encoding="utf-8", errors="replace"))
        if len(ids) >= length:
            return ids
    raise ValueError(f"the standard library holds fewer than {length} tokens")


def proposal_seconds(ids: list[int], context: int, n: int, rounds: int) -> list[float]:
    """Seconds of ``propose`` + ``update`` in each of ``rounds`` rounds after ``ids[:context]``."""
    text = Text(mx.array(ids[:context], dtype=mx.uint32), ids[:context])
    drafter = PromptLookupDrafter()
    drafter.start(text, DraftSetup(make_rule(None)))
    seconds = []
    for _ in range(rounds):
        start = time.perf_counter()
        draft = drafter.propose(text, n, None)
        proposed = time.perf_counter() - start
        # What the round decides, untimed: the draft tokens that agree with the source.
        tokens, at = draft.tokens.tolist(), len(text)
        kept = 0
        while kept < len(tokens) and tokens[kept] == ids[at + kept]:
            kept += 1
        text.extend(ids[at : at + kept + 1])
        start = time.perf_counter()
        drafter.update(text, kept)
        seconds.append(proposed + time.perf_counter() - start)
    return seconds


def round_seconds(target: nn.Module, ids: list[int], n: int, rounds: int) -> list[float]:
    """Seconds of a target call over ``n + 1`` positions after ``ROUND_CONTEXT`` cached tokens,
    its greedy acceptance and the read, in each of ``rounds`` rounds (the caches trimmed back)."""
    cache = make_prompt_cache(target)
    mx.eval(target(mx.array(ids[:ROUND_CONTEXT])[None], cache=cache))
    fed = mx.array(ids[ROUND_CONTEXT : ROUND_CONTEXT + n + 1])[None]
    draft = mx.array(ids[ROUND_CONTEXT + 1 : ROUND_CONTEXT + n + 1], dtype=mx.uint32)
    seconds = []
    for i in range(rounds + 2):
        start = time.perf_counter()
        read(accept_greedy(target(fed, cache=cache)[0], draft))
        if i >= 2:  # two untimed rounds first: compilation, buffers
            seconds.append(time.perf_counter() - start)
        for layer in cache:
            layer.trim(n + 1)
    return seconds


def main(argv: list[str] | None = None) -> list[dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1000, 100000])
    parser.add_argument("--drafts", type=int, nargs="+", default=[1, 8], help="N")
    parser.add_argument("--rounds", type=int, default=200, help="timed rounds per setting")
    args = parser.parse_args(argv)
    target, _, tokenizer = bench.load_demo_pair()
    most = max(args.drafts)
    ids = corpus(tokenizer, max(*args.contexts, ROUND_CONTEXT) + args.rounds * (most + 1) + 1)
    m = bench.machine()
    print(
        f"# proposal cost: {m['date']}, {m['system']}, {m['cpu_count']} cores, MLX {m['mlx']} "
        f"({m['device']}); medians of {args.rounds} rounds; a round of the demo target at "
        f"{ROUND_CONTEXT} tokens of context\n"
    )
    print("| context | N | propose + update (us) | round of the target (ms) | proposal / round |")
    print("|---|---|---|---|---|")
    rows = []
    for n in args.drafts:
        round_time = statistics.median(round_seconds(target, ids, n, args.rounds))
        for context in args.contexts:
            cost = statistics.median(proposal_seconds(ids, context, n, args.rounds))
            rows.append({"context": context, "N": n, "proposal": cost, "round": round_time})
            print(
                f"| {context} | {n} | {cost * 1e6:.1f} | {round_time * 1e3:.2f} | "
                f"{cost / round_time:.2%} |",
                flush=True,
            )
    return rows


if __name__ == "__main__":
    main()
