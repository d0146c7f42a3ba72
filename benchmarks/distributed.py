"""Does speculation pay on a target split over processes? Plain decoding against speculation, on a
target split over the ranks of ``mlx.launch`` and, for comparison, whole in one process.

Every call of a split target waits for its collectives (two all-sums a layer for tensor
parallelism), so a round that yields several tokens saves several of those waits.

Layouts, each measured with :func:`mlx_spec.bench.measure` (methods interleaved prompt by prompt,
first use and steady state, after a warm-up):

- ``split``: the target split over every rank with ``model.shard(group)`` (the demo target is
  loaded with :func:`mlx_spec.distributed.load_sharded`); every rank runs every method, and the
  draft model is whole on each rank;
- ``whole`` (``--whole``): the same target whole on rank 0, while the other ranks wait.

Methods (:func:`mlx_spec.bench.methods`): plain decoding, mlx-lm's speculative loop, and mlx-spec
with the draft model and with prompt lookup, at each fixed ``N`` of ``--drafts`` and adaptive up
to 8. Rank 0 prints one table per layout (tokens/s and the ratios within that layout) and, with
``--whole``, each method's speedup over plain decoding split against whole (above 1: speculation
pays more on the split target).

Pairs (``--pair``): ``demo`` (the shipped pair, on its input-grounded and open prompts) or the
GPU-sized random pairs of ``benchmarks/generation.py`` (``16x2048``, ``16x4096``, ``random``).

Usage::

    mlx.launch -n 2 --backend ring -- python benchmarks/distributed.py [--pair demo] [--whole]
        [--workload open] [--temps 0 0.8] [--drafts 2 4] [--prompts P] [--tokens T] [--json PATH]
    python benchmarks/distributed.py    # one process: the whole target only
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generation_stream

sys.path.insert(0, str(Path(__file__).resolve().parent))

from generation import WORKLOADS, build_pair

from mlx_spec import bench
from mlx_spec._demo import DEMO_DIR
from mlx_spec.distributed import load_sharded

PAIRS = ("demo", "random", "16x2048", "16x4096")


def barrier(group: mx.distributed.Group) -> None:
    """Waits for every rank; on the models' stream, so that it follows their collectives that
    mlx-lm's plain decoding leaves in flight."""
    mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=generation_stream))


def split_target(pair: str, prompts: int, group: mx.distributed.Group) -> nn.Module:
    """The pair's target split over ``group`` (tensor parallel)."""
    if pair == "demo":
        return load_sharded(DEMO_DIR / "target", group)[0]
    # The random recipe is seeded, so every rank builds the same weights, then keeps its share.
    target = build_pair(pair, prompts).target
    target.shard(group)
    mx.eval(target.parameters())
    return target


def methods(
    layout: str, target: nn.Module, draft: nn.Module, drafts: Sequence[int]
) -> list[bench.Method]:
    """:func:`mlx_spec.bench.methods` on ``target``, labelled with the layout."""
    return [
        bench.Method(m.name, m.generate, m.drafter, m.n, m.adaptive, layout)
        for m in bench.methods(target, draft, drafts)
    ]


def speedups(lines: Sequence[dict[str, Any]]) -> str:
    """A Markdown table: each method's speedup over plain decoding, split against whole."""
    x = {(s["model"], s["workload"], s["temp"], s["name"]): s["x_plain"] for s in lines}
    out = [
        "| workload | temp | method | split x plain | whole x plain | split / whole |",
        "|---" * 6 + "|",
    ]
    for (layout, workload, temp, name), split in x.items():
        whole = x.get(("whole", workload, temp, name))
        if layout != "split" or name == "plain" or whole is None:
            continue
        out.append(
            f"| {workload} | {temp:.1f} | {name} | {split:.2f}x | {whole:.2f}x "
            f"| {split / whole:.2f} |"
        )
    return "\n".join(out)


def setup_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pair", choices=PAIRS, default="demo")
    parser.add_argument("--workload", choices=WORKLOADS, nargs="+", default=list(WORKLOADS))
    parser.add_argument("--temps", type=float, nargs="+", default=[0.0, 0.8])
    parser.add_argument("--drafts", type=int, nargs="+", default=[2, 4], help="fixed N")
    parser.add_argument("--prompts", type=int, default=2, help="prompts per workload")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per generation")
    parser.add_argument("--whole", action="store_true", help="also the whole target on rank 0")
    parser.add_argument("--json", type=Path, help="rank 0: the machine, settings and raw rows")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = setup_arg_parser().parse_args(argv)
    group = mx.distributed.init()
    rank, size = group.rank(), group.size()
    pair = build_pair(args.pair, args.prompts)
    workloads = {k: pair.workloads[k] for k in args.workload}
    layouts = {"split": split_target(args.pair, args.prompts, group)} if size > 1 else {}
    if args.whole or size == 1:
        layouts["whole"] = pair.target
    results: dict[str, Any] = {
        "machine": bench.machine() | {"ranks": size},
        "settings": vars(args) | {"json": None},
        "rows": [],
    }
    quiet = rank != 0

    def progress(label: str) -> None:
        if not quiet:
            print(f"[{label}] ...", file=sys.stderr, flush=True)

    def keep(row: dict[str, Any]) -> None:
        results["rows"].append(row)
        if args.json and not quiet:
            bench.write_json(results, args.json)

    for layout, target in layouts.items():
        # The whole target runs on rank 0 alone (its calls have no collectives).
        if layout == "split" or rank == 0:
            compared = methods(layout, target, pair.draft, args.drafts)
            bench.warm_up(compared, pair.warm, args.temps)
            bench.measure(compared, workloads, args.temps, args.tokens, keep, progress)
        if size > 1:
            barrier(group)
    if quiet:
        return
    m = results["machine"]
    print(
        f"# distributed: {m['system']}, MLX {m['mlx']} ({m['device']}), {size} rank(s); "
        f"pair {args.pair}, target {' and '.join(layouts)}; {args.prompts} prompt(s) per "
        f"workload x {args.tokens} tokens\n"
    )
    lines = bench.summarize(results["rows"])
    for layout in layouts:
        print(f"## {layout}\n\n{bench.table([s for s in lines if s['model'] == layout])}\n")
    if len(layouts) == 2:
        print(f"## split against whole\n\n{speedups(lines)}")


if __name__ == "__main__":
    main()
