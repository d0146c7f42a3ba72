"""Does speculation pay more when the target is split over processes? Plain decoding against
speculation, on the demo target split over the ranks of ``mlx.launch`` and whole in one process.

Every target call of a split target waits for its collectives (two all-sums a layer for tensor
parallelism), so a round that yields several tokens saves several of those waits. For each
temperature and method this prints tokens/s and the speedup over plain decoding in the same
layout; the last column divides a method's speedup on the split target by its speedup on the whole
one (above 1: speculation pays more when split).

Layouts, measured in this one run: ``split``, the demo target loaded with
:func:`mlx_spec.distributed.load_sharded` (tensor parallel, every rank running every method);
``whole``, the demo target on rank 0 alone while the other ranks wait at a barrier. Layouts and
methods run interleaved prompt by prompt, after a warm-up, so that load on the machine affects
them alike; every rank uses the same seeds, and the draft model is replicated. Only rank 0
prints.

Usage::

    mlx.launch -n 2 --backend ring -- python benchmarks/distributed.py [--tokens T] [--prompts P]
        [--drafts 1 2] [--temps 0 1]
    python benchmarks/distributed.py    # one process: the whole target only
"""

from __future__ import annotations

import argparse
import platform
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm import load
from mlx_lm.generate import generation_stream

from mlx_spec.bench import DEMO_DIR, PROMPTS, Tally, run_mlx_spec, run_plain
from mlx_spec.distributed import load_sharded


@dataclass(frozen=True)
class Setup:
    """What a method runs on: the target (split or whole), the draft and the draft length."""

    target: nn.Module
    draft: nn.Module
    num_draft_tokens: int


# Method name -> how it generates ``tokens`` from ``prompt`` at ``temp`` with ``seed``. A new
# drafter is one more line here (prompt lookup, once the loop has it).
METHODS: dict[str, Callable[[Setup, mx.array, float, int, int], Tally]] = {
    "plain": lambda s, prompt, temp, seed, tokens: run_plain(prompt, s.target, temp, seed, tokens),
    "draft model": lambda s, prompt, temp, seed, tokens: run_mlx_spec(
        prompt, s.target, s.draft, s.num_draft_tokens, temp, seed, tokens
    ),
}

Key = tuple[str, float, str]  # (layout, temperature, method label)


def barrier(group: mx.distributed.Group) -> None:
    """Waits for every rank; on the models' stream, so that it follows their collectives that
    mlx-lm's plain decoding leaves in flight."""
    mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=generation_stream))


def run_methods(
    setups: dict[int, Setup], prompt: mx.array, temp: float, seed: int, max_tokens: int
) -> dict[str, Tally]:
    """Every method on one prompt, each draft length of the speculative ones."""
    tallies = {}
    for name, method in METHODS.items():
        for n in setups if name != "plain" else list(setups)[:1]:
            label = name if name == "plain" else f"{name}, N = {n}"
            tallies[label] = method(setups[n], prompt, temp, seed, max_tokens)
    return tallies


def measure(
    layouts: dict[str, dict[int, Setup]],
    group: mx.distributed.Group,
    prompts: Sequence[mx.array],
    temps: Sequence[float],
    max_tokens: int,
) -> dict[Key, Tally]:
    """Every layout and method at every temperature, interleaved prompt by prompt.

    A layout missing on this rank (the whole target, off rank 0) is waited out at a barrier.
    """
    tallies: dict[Key, Tally] = {}
    for temp in temps:
        for seed, prompt in enumerate([prompts[0], *prompts]):
            for layout in ("split", "whole"):
                if layout in layouts:
                    runs = run_methods(layouts[layout], prompt, temp, seed, max_tokens)
                    # The first prompt, run twice, warms up: compiled kernels, buffer cache.
                    for label, tally in runs.items() if seed > 0 else ():
                        tallies.setdefault((layout, temp, label), Tally())
                        tallies[(layout, temp, label)] += tally
                if group.size() > 1:
                    barrier(group)
    return tallies


def speedup(tallies: dict[Key, Tally], key: Key) -> float:
    """A method's tokens/s over plain decoding's in the same layout and at the same temperature."""
    layout, temp, _ = key
    return tallies[key].tokens_per_second / tallies[(layout, temp, "plain")].tokens_per_second


def table(tallies: dict[Key, Tally]) -> str:
    """One row per temperature and method: both layouts' tokens/s, speedups and their ratio."""
    lines = [
        "| temp | method | tokens/round | split tok/s | split speedup | whole tok/s "
        "| whole speedup | split / whole |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for _, temp, label in [k for k in tallies if k[0] == "whole"]:
        split, whole = ("split", temp, label), ("whole", temp, label)
        cells = [f"{temp:g}", label, f"{tallies[whole].tokens_per_round:.2f}"]
        if split in tallies:
            cells += [f"{tallies[split].tokens_per_second:.1f}", f"{speedup(tallies, split):.2f}x"]
        else:
            cells += ["-", "-"]
        cells += [f"{tallies[whole].tokens_per_second:.1f}", f"{speedup(tallies, whole):.2f}x"]
        ratio = speedup(tallies, split) / speedup(tallies, whole) if split in tallies else None
        cells.append(f"{ratio:.2f}" if ratio is not None else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=64, help="tokens per generation")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per setting")
    parser.add_argument("--drafts", type=int, nargs="+", default=[1, 2], help="values of N")
    parser.add_argument("--temps", type=float, nargs="+", default=[0.0, 1.0], help="temperatures")
    args = parser.parse_args()

    group = mx.distributed.init()
    rank, size = group.rank(), group.size()
    draft, tokenizer = load(str(DEMO_DIR / "draft"))
    prompts = [mx.array(tokenizer.encode(PROMPTS[i % len(PROMPTS)])) for i in range(args.prompts)]
    targets = {}
    if size > 1:
        targets["split"] = load_sharded(DEMO_DIR / "target", group)[0]
    if rank == 0:
        targets["whole"] = load(str(DEMO_DIR / "target"))[0]
    layouts = {
        layout: {n: Setup(target, draft, n) for n in args.drafts}
        for layout, target in targets.items()
    }
    tallies = measure(layouts, group, prompts, args.temps, args.tokens)
    if rank == 0:
        layouts = f"split over {size} ranks and whole on rank 0" if size > 1 else "whole"
        print(
            f"# distributed: {platform.system()} {platform.machine()}, MLX {mx.__version__}, "
            f"{mx.default_device()}; demo pair (bfloat16), target {layouts}; "
            f"{args.prompts} prompt(s) x {args.tokens} tokens"
        )
        print(table(tallies))


if __name__ == "__main__":
    main()
