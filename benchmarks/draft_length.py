"""How well does the adaptive draft length choose, on a device whose costs are modelled?

Timed runs on a shared GPU vary by more than the choices they are meant to compare. This
benchmark runs the real loop on the demo pair (or another pair of ``benchmarks/generation.py``),
so the tokens, the drafts and the choices are those of a real generation, but charges every
round and every plain step a modelled cost, in units of one plain decoding step:

- a verification round: ``round + position * (positions scored) + draft_step * (draft calls)``;
- a plain step (plain decoding, or the loop's plain steps): 1;
- the first plain step after a round: ``stretch_start`` more. Plain decoding builds each step
  while the one before runs; the first step after a round has nothing in flight to hide its host
  work behind.

The policies see the modelled costs through the public seam alone: the adaptive policy is given
them as its :class:`~mlx_spec.draft_length.Calibration` (what it would measure on that device),
and a wrapper policy charges each outcome the loop reports. Each method's modelled tokens per
unit cost is compared to plain decoding and to the best fixed ``N`` of the same drafter. The
defaults model the H200 on the demo pair (``docs/performance.md``: a round costs about 2.3 plain
steps of host and device work, a scored position a small fraction of one); ``--device cpu``
models this project's CPU, where a scored position costs about what a step does.

Usage: ``python benchmarks/draft_length.py [--pair demo] [--device gpu|cpu] [--temps 0 0.8]
[--drafts 1 2 4 8] [--prompts 2] [--tokens 128]``.
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

from mlx_spec.draft_length import Adaptive, Calibration, DraftPolicy, Fixed, Outcome, Round
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
        stretch_start (float): the first plain step after a round, which waits for its own host
            work.
    """

    round: float
    position: float
    draft_step: float
    stretch_start: float

    def calibration(self, model_drafter: bool) -> Calibration:
        """What the adaptive policy would measure on this device, in plain steps."""
        token = self.position + (self.draft_step if model_drafter else 0.0)
        return Calibration(plain=1.0, round=self.round + self.position, token=token)


DEVICES = {
    # A stretch's first step waits for its own host work: most of a pipelined step where a small
    # target's step is about as long on the host as on the device (a GPU), little where the
    # device's work is most of a step (a CPU that computes every scored position).
    "gpu": Costs(round=2.3, position=0.08, draft_step=0.25, stretch_start=0.6),
    "cpu": Costs(round=0.4, position=0.6, draft_step=0.25, stretch_start=0.1),
}


class Charged:
    """A draft-length policy that lets ``policy`` choose and charges what the loop reports.

    Args:
        policy (DraftPolicy): the policy under test.
        costs (Costs): the modelled device.
        model_drafter (bool): whether each draft token costs a draft model's call.

    Attributes:
        cost (float): the modelled cost so far, in plain steps.
    """

    def __init__(self, policy: DraftPolicy, costs: Costs, model_drafter: bool) -> None:
        self.policy = policy
        self.costs = costs
        self.model_drafter = model_drafter
        self.cost = 0.0

    def choose(self, round: Round) -> int:
        return self.policy.choose(round)

    def observe(self, outcome: Outcome) -> None:
        c = self.costs
        if outcome.plain:
            self.cost += 1 + (c.stretch_start if outcome.first else 0.0)
        else:
            steps = outcome.drafted if self.model_drafter else 0
            self.cost += c.round + c.position * (1 + outcome.drafted) + c.draft_step * steps
        self.policy.observe(outcome)


def modelled_rate(
    target, prompt, temp, policy: DraftPolicy, costs: Costs, *, draft=None, tokens=128
) -> tuple[float, SpeculativeStats]:
    """Tokens per plain step's cost of one generation, and its stats (prompt lookup without
    ``draft``)."""
    charged = Charged(policy, costs, model_drafter=draft is not None)
    stats = SpeculativeStats()
    for _ in speculative_generate_step(
        prompt,
        target,
        draft,
        max_tokens=tokens,
        sampler=make_sampler(temp=temp),
        key=mx.random.key(0),
        stats=stats,
        drafter=None if draft is not None else "prompt-lookup",
        policy=charged,
    ):
        pass
    return stats.generated / charged.cost, stats


def mean_rate(target, temp, costs, draft, tokens, prompts, make_policy) -> tuple[float, float]:
    """The mean modelled rate over ``prompts`` of a policy ``make_policy()`` makes for each,
    and the mean tokens per round."""
    runs = [
        modelled_rate(target, p, temp, make_policy(), costs, draft=draft, tokens=tokens)
        for p in prompts
    ]
    return (
        float(np.mean([r for r, _ in runs])),
        float(np.mean([s.tokens_per_round for _, s in runs])),
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", default="demo")
    parser.add_argument("--device", choices=sorted(DEVICES), default="gpu")
    parser.add_argument("--round", type=float, help="a round's fixed cost (default: the device's)")
    parser.add_argument("--position", type=float, help="a scored position's cost")
    parser.add_argument("--draft-step", type=float, help="a draft model call's cost")
    parser.add_argument(
        "--stretch-start", type=float, help="a plain step's extra cost after a round"
    )
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
        + " | adaptive | adaptive tok/round | x best fixed |"
    )
    print("|---" * (len(args.drafts) + 6) + "|")
    for workload in args.workload:
        for temp in args.temps:
            for kind in args.drafter:
                draft = pair.draft if kind == "draft" else None
                prompts = pair.workloads[workload]

                spec = (pair.target, temp, costs, draft, args.tokens, prompts)
                fixed = [mean_rate(*spec, lambda n=n: Fixed(n))[0] for n in args.drafts]
                calibration = costs.calibration(model_drafter=draft is not None)
                adaptive, per_round = mean_rate(
                    *spec, lambda c=calibration: Adaptive(ADAPTIVE_MOST, c)
                )
                cells = " | ".join(f"{r:.2f}" for r in fixed)
                print(
                    f"| {workload} | {temp} | {kind} | {cells} | {adaptive:.2f} "
                    f"| {per_round:.2f} | {adaptive / max(fixed):.2f}x |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
