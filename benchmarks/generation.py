"""Does speculation pay in generation? Every method interleaved; first use and steady state.

Methods (:func:`mlx_spec.bench.methods`): plain decoding (mlx-lm's ``generate_step``), mlx-lm's
speculative loop, and mlx-spec with the pair's draft model, with prompt lookup and, where the
target has an MTP head (the demo target ships one), with that head, each at every fixed ``N`` of
``--drafts`` and adaptive up to 8. After a warm-up on a prompt of its own, each
method runs on every prompt twice in a row (:func:`mlx_spec.bench.measure`): the first run is its
first use of that prompt's shapes (on MLX's CUDA backend each new shape of an attention call first
builds a cuDNN graph), the second the steady state. The table gives the second run's tokens/s,
the first run's time over the second's, tokens per round, acceptance, tokens fed again
(``replayed``), and the ratios of tokens/s to plain decoding, to mlx-lm's loop at the same ``N``
(draft model, fixed ``N``) and to the fastest fixed ``N`` of the same drafter (adaptive).

Pairs (``--pair``):

- ``demo``: the shipped pair (``mlx_spec/demo``: a trained 6 x 384 bfloat16 target and a
  distilled 1 x 192 draft), on its input-grounded prompts (text that the output repeats) and its
  open ones.
- ``random``: a float32 llama 8 x 384, vocabulary 4096, whose first layer weighs most and whose
  output layer is scaled up (peaked distributions, as a trained model's), and as draft that
  target cut to its first layer.
- ``16x2048``, ``16x4096``: the same recipe at the sizes of a GPU's models: 16 layers of 2048 or
  4096, vocabulary 32000, bfloat16; the draft is the first layer.
- ``hybrid``: a qwen3-next 8 x 384 (gated delta-net layers, whose recurrent state after every
  position of a verification is kept, so a rejection takes the state at the kept length; every
  second layer attention), vocabulary 4096, the same recipe; the draft is its first two layers (a
  qwen3-next needs one of each kind). mlx-lm's loop refuses it (its caches cannot be trimmed), so
  it is left out. Then the cost of taking recurrent caches back: that hybrid, the same hybrid
  with its states not kept (``qwen3-next replayed``: restored from a checkpoint and replayed
  after a rejection, as before they were kept) and an LFM2 of the same size (short-convolution
  layers, always replayed) against an attention-only twin (a llama of the same width, depth,
  heads and MLP, whose caches are trimmed), each with plain decoding and with a drafter that
  proposes the model's own greedy tokens made wrong at fixed positions of the text
  (:class:`ForcedDrafter`, ``--forced-acceptance``). At temperature 0 a target keeps exactly the
  right tokens before the first wrong one, so all of them keep drafts at the same positions: the
  same acceptance whatever their models. The second table sets each hybrid's speedup over its own
  plain decoding beside the twin's.

The random pairs' workloads are random tokens: input-grounded, a segment of 32 shown twice and
begun a third time; open, 32 tokens.

Usage: ``python benchmarks/generation.py [--pair demo|random|16x2048|16x4096|hybrid]
[--workload input-grounded open] [--temps 0 0.8] [--drafts 1 2 4 8] [--prompts P] [--tokens T]
[--forced-acceptance A] [--repeats R] [--quick] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from unittest import mock

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step

from mlx_spec import _mlx_lm, bench
from mlx_spec._demo import WARM_UP
from mlx_spec.drafters import Draft, Drafter, DraftSetup
from mlx_spec.loop import SpeculativeStats, Text

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from tiny_models import cut, tiny_lfm2, tiny_llama, tiny_qwen3_next

PAIRS = ("demo", "random", "16x2048", "16x4096", "hybrid")
# The hybrid pair's comparison of taking recurrent caches back, the twin last.
REPLAY_MODELS = ("qwen3-next", "qwen3-next replayed", "lfm2", "twin")
WORKLOADS = ("input-grounded", "open")
ADAPTIVE_MOST = 8


@dataclass
class Pair:
    """A target, its draft model, and the prompts of each workload.

    Attributes:
        name (str): the ``--pair`` that built it.
        target (nn.Module): the target.
        draft (nn.Module): the draft model.
        workloads (dict): workload name to ``[L]`` prompts.
        warm (array): the warm-up's prompt, apart from the measured ones.
        twin (nn.Module, optional): an attention-only model of the target's size (hybrid only).
        replayed (nn.Module, optional): an LFM2 of the target's size, whose recurrent caches are
            replayed after a rejection (hybrid only).
    """

    name: str
    target: nn.Module
    draft: nn.Module
    workloads: dict[str, list[mx.array]]
    warm: mx.array
    twin: nn.Module | None = None
    replayed: nn.Module | None = None


def _random_prompts(vocab: int, count: int) -> dict[str, list[mx.array]]:
    """Input-grounded prompts (a segment of 32 random tokens twice, then its first 8) and open
    ones (32 random tokens), from fixed keys."""
    segments = [
        mx.random.randint(1, vocab, (32,), key=mx.random.key(100 + i)) for i in range(count)
    ]
    return {
        "input-grounded": [mx.concatenate([s, s, s[:8]]) for s in segments],
        "open": [
            mx.random.randint(1, vocab, (32,), key=mx.random.key(200 + i)) for i in range(count)
        ],
    }


def _llama(layers: int, hidden: int, vocab: int, heads: int, intermediate: int) -> nn.Module:
    """The random recipe: layer 0 scaled by 3, the later ones by 0.8, the output layer by 6."""
    scales = (3.0,) + (0.8,) * (layers - 1)
    return tiny_llama(
        0,
        vocab=vocab,
        layers=layers,
        scales=scales,
        head=6.0,
        heads=heads,
        hidden=hidden,
        intermediate=intermediate,
    )


def build_pair(name: str, prompts: int) -> Pair:
    """The pair ``--pair name`` with ``prompts`` prompts per workload."""
    if name == "demo":
        target, draft, tokenizer = bench.load_demo_pair()
        workloads = bench.demo_workloads(tokenizer, prompts)
        return Pair(name, target, draft, workloads, mx.array(tokenizer.encode(WARM_UP)))
    warm = mx.arange(1, 17)
    if name == "hybrid":
        target = tiny_qwen3_next(0, vocab=4096, layers=8, hidden=384, early=3.0, late=0.8, head=6.0)
        twin = _llama(8, 384, 4096, heads=4, intermediate=2 * 384)
        replayed = tiny_lfm2(0, vocab=4096, layers=8, hidden=384, head=6.0, late=0.4)
        workloads = _random_prompts(4096, prompts)
        return Pair(name, target, cut(target, 2), workloads, warm, twin, replayed)
    if name == "random":
        target = _llama(8, 384, 4096, heads=6, intermediate=4 * 384)
    else:
        layers, hidden = map(int, name.split("x"))
        target = _llama(layers, hidden, 32000, heads=32, intermediate=4 * hidden)
        target.set_dtype(mx.bfloat16)
        mx.eval(target.parameters())
    return Pair(
        name, target, cut(target, 1), _random_prompts(target.args.vocab_size, prompts), warm
    )


class ForcedDrafter(Drafter):
    """Proposes the target's own greedy continuation, wrong where ``wrong`` says.

    At temperature 0 the target keeps a draft token exactly when it is the target's greedy token
    and every draft token before it in the round was kept; so two targets whose drafters share
    ``wrong`` keep drafts at the same positions of their texts, whatever their models.

    Args:
        reference (list of int): the target's greedy tokens after the prompt.
        wrong (sequence of bool): for each position after the prompt, whether to propose another
            token than the reference's there.
        vocab (int): the target's vocabulary (a wrong token is the next id).
    """

    free = True

    def __init__(self, reference: list[int], wrong: Sequence[bool], vocab: int) -> None:
        self.reference = reference
        self.wrong = wrong
        self.vocab = vocab
        self._prompt = 0

    def start(self, text: Text, setup: DraftSetup) -> None:
        self._prompt = len(text)

    def propose(self, text: Text, n: int, keys: mx.array | None) -> Draft:
        i = len(text) - self._prompt
        right = self.reference[i : i + n]
        tokens = [
            (t + 1) % self.vocab if w else t for t, w in zip(right, self.wrong[i:], strict=False)
        ]
        return Draft(mx.array(tokens, dtype=mx.uint32))


def forced(
    target: nn.Module, prompts: Sequence[mx.array], length: int, wrong: Sequence[bool]
) -> Callable[[mx.array], Drafter]:
    """A function building the :class:`ForcedDrafter` of ``target`` for each of ``prompts``: their
    ``length`` greedy tokens are computed here, before any timing."""
    references = {
        # The measured prompts are these very arrays.
        id(p): [t for t, _ in generate_step(p, target, max_tokens=length)]
        for p in prompts
    }
    vocab = target.args.vocab_size
    return lambda prompt: ForcedDrafter(references[id(prompt)], wrong, vocab)


def replay_methods(
    pair: Pair,
    prompts: Sequence[mx.array],
    drafts: Sequence[int],
    max_tokens: int,
    acceptance: float,
) -> list[bench.Method]:
    """Plain decoding and the forced drafter at each ``N`` of ``drafts``, on the hybrid target (its
    states kept, and not), the LFM2 and their twin, with the same wrong positions, for
    ``prompts``."""
    length = max_tokens + max(drafts) + 1
    wrong = np.random.default_rng(0).random(length) >= acceptance
    out = []
    for label in REPLAY_MODELS:
        model = {"lfm2": pair.replayed, "twin": pair.twin}.get(label, pair.target)
        drafter = forced(model, prompts, length, wrong)
        methods = [replace(bench.plain(model), name=f"{label} plain", model=label)]
        methods += [
            replace(
                bench.mlx_spec(model, n, drafter=drafter),
                name=f"{label} forced N={n}",
                drafter="forced",
                model=label,
            )
            for n in drafts
        ]
        out += [_replaying(m) for m in methods] if label == "qwen3-next replayed" else methods
    return out


def _replaying(method: bench.Method) -> bench.Method:
    """``method`` with no recurrent layer's states kept: its caches are restored and replayed."""

    def generate(*args: Any) -> SpeculativeStats:
        with mock.patch.object(_mlx_lm, "track", lambda model: 0):
            return method.generate(*args)

    return replace(method, generate=generate)


def replay_table(lines: Sequence[dict[str, Any]]) -> str:
    """Each hybrid's speedup over its plain decoding beside the twin's, per workload and ``N``,
    from lines of :func:`mlx_spec.bench.summarize` of :func:`replay_methods`."""
    out = [
        "| workload | hybrid | N | tok/round | tok/round twin | replayed / token | x plain "
        "| twin x plain | hybrid / twin |",
        "|---" * 9 + "|",
    ]
    rows = {(s["workload"], s["model"], s["n"]): s for s in lines if s["drafter"] == "forced"}
    for (workload, model, n), h in sorted(
        rows.items(), key=lambda item: REPLAY_MODELS.index(item[0][1])
    ):
        if model == "twin":
            continue
        t = rows[workload, "twin", n]
        out.append(
            f"| {workload} | {model} | {n} | {h['tokens_per_round']:.2f} | "
            f"{t['tokens_per_round']:.2f} | {h['replayed'] / h['generated']:.2f} | "
            f"{h['x_plain']:.2f}x | {t['x_plain']:.2f}x | {h['x_plain'] / t['x_plain']:.2f}x |"
        )
    return "\n".join(out)


def describe(pair: Pair) -> str:
    """The pair's sizes, dtypes and vocabulary, read from its models."""

    def size(model: nn.Module) -> str:
        params = [p for _, p in tree_flatten(model.parameters())]
        dtype = str(params[0].dtype).removeprefix("mlx.core.")
        count = sum(p.size for p in params) / 1e6
        return f"{len(model.layers)} x {model.args.hidden_size} ({count:.1f}M, {dtype})"

    twin = f", twin {size(pair.twin)}" if pair.twin is not None else ""
    if pair.replayed is not None:
        twin += f", LFM2 {size(pair.replayed)}"
    return (
        f"pair {pair.name}: target {size(pair.target)}, draft {size(pair.draft)}{twin}, "
        f"V = {pair.target.args.vocab_size}"
    )


def _progress(label: str) -> None:
    print(f"[{label}] ...", file=sys.stderr, flush=True)


def setup_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pair", choices=PAIRS, default="demo")
    parser.add_argument("--workload", choices=WORKLOADS, nargs="+", default=list(WORKLOADS))
    parser.add_argument("--temps", type=float, nargs="+", default=[0.0, 0.8])
    parser.add_argument("--drafts", type=int, nargs="+", help="fixed N (default: 1 2 4 8)")
    parser.add_argument(
        "--mtp-drafts",
        type=int,
        nargs="+",
        help="fixed N of a target's MTP head, where it has one (default: 1 2 3 4)",
    )
    parser.add_argument("--prompts", type=int, help="prompts per workload (default: 4)")
    parser.add_argument("--tokens", type=int, help="tokens per generation (default: 128)")
    parser.add_argument(
        "--forced-acceptance",
        type=float,
        default=0.75,
        help="hybrid: the chance that the forced drafter's token is right (default: 0.75)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="hybrid: how many times the comparison runs each prompt, interleaved (default: 1)",
    )
    parser.add_argument(
        "--variants",
        type=int,
        metavar="N",
        help="also, at this N: the draft model by rejection sampling (and adaptive up to N by "
        "it), and each drafter with the fused CUDA kernels turned off (mlx_spec.bench.variants)",
    )
    parser.add_argument("--quick", action="store_true", help="N = 2, one prompt, 16 tokens")
    parser.add_argument(
        "--json", type=Path, help="the machine, settings and raw rows, written after each row"
    )
    return parser


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = setup_arg_parser().parse_args(argv)
    settings = {
        "workloads": args.workload,
        "temps": args.temps,
        "drafts": args.drafts or ([2] if args.quick else [1, 2, 4, 8]),
        "mtp_drafts": args.mtp_drafts or ([2] if args.quick else [1, 2, 3, 4]),
        "adaptive_most": ADAPTIVE_MOST,
        "prompts": args.prompts or (1 if args.quick else 4),
        "max_tokens": args.tokens or (16 if args.quick else 128),
        "forced_acceptance": args.forced_acceptance,
        "repeats": args.repeats,
    }
    drafts, max_tokens = settings["drafts"], settings["max_tokens"]
    pair = build_pair(args.pair, settings["prompts"])
    workloads = {k: pair.workloads[k] for k in args.workload}
    methods = bench.methods(
        pair.target, pair.draft, drafts, ADAPTIVE_MOST, mtp_drafts=settings["mtp_drafts"]
    )
    if args.variants:
        methods += bench.variants(pair.target, pair.draft, args.variants)
    if pair.twin is not None:
        # mlx-lm's loop refuses caches it cannot trim.
        methods = [m for m in methods if m.drafter != "mlx-lm"]
    results: dict[str, Any] = {
        "machine": bench.machine(),
        "settings": settings,
        "pair": describe(pair),
        "rows": [],
        "replay": [],
    }

    def keep(part: str) -> Callable[[dict[str, Any]], None]:
        def add(row: dict[str, Any]) -> None:
            results[part].append(row)
            if args.json:
                bench.write_json(results, args.json)

        return add

    if args.json:
        bench.write_json(results, args.json)
    m = results["machine"]
    print(
        f"# generation: {m['date']}, {m['system']}, {m['cpu_count']} cores, MLX {m['mlx']} "
        f"({m['device']}), mlx-lm {m['mlx_lm']}; {results['pair']}; {settings['prompts']} "
        f"prompt(s) per workload x {max_tokens} tokens\n",
        flush=True,
    )
    bench.warm_up(methods, pair.warm, args.temps)
    rows = bench.measure(methods, workloads, args.temps, max_tokens, keep("rows"), _progress)
    print(bench.table(bench.summarize(rows)), flush=True)
    if pair.twin is not None:
        every = [pair.warm, *(p for ps in workloads.values() for p in ps)]
        twins = replay_methods(pair, every, drafts, max_tokens, args.forced_acceptance)
        bench.warm_up(twins, pair.warm, [0.0])
        # Each prompt again and again: on a shared GPU single runs spread more than the effect.
        repeated = {k: list(ps) * args.repeats for k, ps in workloads.items()}
        replay = bench.measure(twins, repeated, [0.0], max_tokens, keep("replay"), _progress)
        print(
            "\n## Taking recurrent caches back: temperature 0, a forced drafter right with "
            "probability "
            f"{args.forced_acceptance}\n"
        )
        print(replay_table(bench.summarize(replay)))
    return results


if __name__ == "__main__":
    main()
