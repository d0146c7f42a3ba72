"""How well does the adaptive draft length choose, on a device whose costs are modelled?

Timed runs on a shared GPU vary by more than the choices they are meant to compare. This
benchmark runs the real loop on the demo pair (or another pair of ``benchmarks/generation.py``),
so the tokens, the drafts and the choices are those of a real generation, but charges every
round and every plain step a modelled cost, in units of one plain decoding step:

- a verification round: ``round + position * (positions scored) + draft_step * (draft calls)``,
  with a deterministic noise of ``--noise`` (relative, uniform) so that the estimates see what
  a machine's clock shows;
- a plain step (plain decoding, or a stretch of the adaptive loop): 1;
- the start of each stretch of the adaptive loop: ``stretch_start`` more. Plain decoding builds
  each step while the one before runs; a stretch's first step has nothing in flight to hide its
  host work behind, and the step the last one built ahead of the stretch's end is not there.

The adaptive choice is fed these costs instead of the measured seconds, and each method's modelled
tokens per unit cost is compared to plain decoding and to the best fixed ``N`` of the same drafter.
Each adaptive generation runs twice: measuring its costs from scratch, and again starting from the
costs the first run kept (``costs kept``: what a process's later generations of the same models
do, see :mod:`mlx_spec.draft_length`).
The defaults model the H200 on the demo pair (``docs/performance.md``: a round costs about 2.3
plain steps of host and device work, a scored position a small fraction of one); ``--device cpu``
models this project's CPU, where a scored position costs about what a step does.

Usage: ``python benchmarks/draft_length.py [--pair demo] [--device gpu|cpu] [--temps 0 0.8]
[--drafts 1 2 4 8] [--prompts 2] [--tokens 128] [--noise 0.1]``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from generation import WORKLOADS, build_pair

import mlx_spec.generation as generation_module
import mlx_spec.loop as loop_module
from mlx_spec.draft_length import DraftLength, forget_costs
from mlx_spec.generation import speculative_generate_step
from mlx_spec.loop import SpeculativeStats
from mlx_spec.sampling import make_sampler

ADAPTIVE_MOST = 8


@dataclass(frozen=True)
class Costs:
    """A device's costs, in plain steps.

    Attributes:
        round (float): a verification round's fixed cost (host work, launches, the read).
        position (float): each scored position (the waiting tokens and the drafts).
        draft_step (float): each call of a draft model.
        stretch_start (float): each stretch of plain steps, for its first step, which waits for
            its own host work.
        noise (float): the relative spread of a round's cost as the loop sees it.
    """

    round: float
    position: float
    draft_step: float
    stretch_start: float
    noise: float


DEVICES = {
    # A stretch's first step waits for its own host work: most of a pipelined step where a small
    # target's step is about as long on the host as on the device (a GPU), little where the
    # device's work is most of a step (a CPU that computes every scored position).
    "gpu": Costs(round=2.3, position=0.08, draft_step=0.25, stretch_start=0.6, noise=0.1),
    "cpu": Costs(round=0.4, position=0.6, draft_step=0.25, stretch_start=0.1, noise=0.1),
}


class _Ledger:
    """The modelled cost of one generation, filled by :class:`_Modelled`."""

    def __init__(self, costs: Costs, seed: int) -> None:
        self.costs = costs
        self.rng = np.random.default_rng(seed)
        self.rounds = 0.0
        self.round_tokens = 0
        # The stretches of plain steps begun, and the steps of the current one.
        self.stretches = 0
        self.stretch_steps = 0


def _modelled(ledger: _Ledger) -> type[DraftLength]:
    """A DraftLength that is told the modelled costs instead of the measured seconds."""

    class Modelled(DraftLength):
        def record(self, drafted, accepted, fed, steps, seconds, label=0):
            c = ledger.costs
            cost = c.round + c.position * fed + c.draft_step * steps
            ledger.rounds += cost
            ledger.round_tokens += accepted + 1
            noisy = cost * (1 + c.noise * ledger.rng.uniform(-1, 1))
            super().record(drafted, accepted, fed, steps, noisy, label)

        def record_plain(self, seconds):
            c = ledger.costs
            step = 1 + c.stretch_start / max(ledger.stretch_steps, 1)
            super().record_plain(step * (1 + c.noise * ledger.rng.uniform(-1, 1)))

        def record_restart(self, seconds):
            c = ledger.costs
            first = (1 + c.stretch_start) * (1 + c.noise * ledger.rng.uniform(-1, 1))
            super().record_restart(first)

    return Modelled


def _counted_stretch(ledger: _Ledger):
    """Generation.stretch, counting the stretches begun and their steps into ``ledger``."""
    stretch = loop_module.Generation.stretch

    def counted(self, count):
        ledger.stretches += 1
        ledger.stretch_steps = 0
        for step in stretch(self, count):
            ledger.stretch_steps += 1
            yield step

    return counted


def modelled_rate(
    target,
    prompt,
    temp,
    n,
    costs,
    *,
    draft=None,
    drafter=None,
    adaptive=False,
    tokens=128,
    kept=False,
) -> tuple[float, SpeculativeStats]:
    """Tokens per plain step's cost of one generation, and its stats. The generation measures
    its costs from scratch, or with ``kept`` starts from those the last generation of the same
    models measured (as a process's later generations do)."""
    if not kept:
        forget_costs()
    ledger = _Ledger(costs, seed=n + 100 * adaptive)
    stats = SpeculativeStats()
    original = generation_module.DraftLength, loop_module.Generation.stretch
    generation_module.DraftLength = _modelled(ledger)
    loop_module.Generation.stretch = _counted_stretch(ledger)
    try:
        for _ in speculative_generate_step(
            prompt,
            target,
            draft,
            num_draft_tokens=n,
            max_tokens=tokens,
            sampler=make_sampler(temp=temp),
            key=mx.random.key(0),
            stats=stats,
            drafter=drafter,
            adaptive=adaptive,
        ):
            pass
    finally:
        generation_module.DraftLength, loop_module.Generation.stretch = original
    plain_tokens = max(stats.generated - ledger.round_tokens, 0)
    cost = ledger.rounds + plain_tokens + ledger.costs.stretch_start * ledger.stretches
    return stats.generated / cost, stats


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", default="demo")
    parser.add_argument("--device", choices=sorted(DEVICES), default="gpu")
    parser.add_argument("--round", type=float, help="a round's fixed cost (default: the device's)")
    parser.add_argument("--position", type=float, help="a scored position's cost")
    parser.add_argument("--draft-step", type=float, help="a draft model call's cost")
    parser.add_argument("--stretch-start", type=float, help="a stretch's extra cost")
    parser.add_argument("--workload", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--temps", type=float, nargs="+", default=[0.0, 0.8])
    parser.add_argument("--drafts", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument(
        "--drafter", choices=["draft", "lookup"], nargs="+", default=["draft", "lookup"]
    )
    args = parser.parse_args(argv)
    pair = build_pair(args.pair, args.prompts)
    given = {
        "round": args.round,
        "position": args.position,
        "draft_step": args.draft_step,
        "stretch_start": args.stretch_start,
    }
    costs = replace(DEVICES[args.device], **{k: v for k, v in given.items() if v is not None})
    print(f"# modelled {args.device}: {costs}; pair {args.pair}, {args.tokens} tokens")
    print(
        "| workload | temp | drafter | "
        + " | ".join(f"N={n}" for n in args.drafts)
        + " | adaptive | adaptive tok/round | x best fixed | adaptive, costs kept "
        + "| x best fixed, costs kept |"
    )
    print("|---" * (len(args.drafts) + 8) + "|")
    for workload in args.workload:
        for temp in args.temps:
            for kind in args.drafter:
                spec = {"draft": pair.draft} if kind == "draft" else {"drafter": "prompt-lookup"}
                fixed = [
                    np.mean(
                        [
                            modelled_rate(
                                pair.target, p, temp, n, costs, tokens=args.tokens, **spec
                            )[0]
                            for p in pair.workloads[workload]
                        ]
                    )
                    for n in args.drafts
                ]
                runs, again = [], []
                for p in pair.workloads[workload]:
                    for kept, into in ((False, runs), (True, again)):
                        into.append(
                            modelled_rate(
                                pair.target,
                                p,
                                temp,
                                ADAPTIVE_MOST,
                                costs,
                                adaptive=True,
                                tokens=args.tokens,
                                kept=kept,
                                **spec,
                            )
                        )
                rate = np.mean([r for r, _ in runs])
                per_round = np.mean([s.tokens_per_round for _, s in runs])
                rate_again = np.mean([r for r, _ in again])
                cells = " | ".join(f"{r:.2f}" for r in fixed)
                print(
                    f"| {workload} | {temp} | {kind} | {cells} | {rate:.2f} | {per_round:.2f} "
                    f"| {rate / max(fixed):.2f}x | {rate_again:.2f} "
                    f"| {rate_again / max(fixed):.2f}x |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
