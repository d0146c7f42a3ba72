"""``mlx-spec demo``: speculative decoding on the shipped model pair, with no download.

On an input-grounded prompt (text the output repeats) and an open one, at two temperatures, the
draft model, prompt lookup and the target's own MTP head (where the shipped target has one) stream
completions with the accepted draft tokens marked; then a table compares plain decoding, mlx-lm's
speculative decoding and mlx-spec with each drafter, over ``--repeats`` (:data:`REPEATS` by
default) interleaved runs: the median and range of each one's tokens/s and of its ratio to plain
decoding, whether the machine held still enough for a verdict (from plain decoding's own spread:
:func:`mlx_spec.bench.noise`), and a verdict per drafter (:func:`mlx_spec.bench.verdicts`).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Any

from .._demo import DEMO_DIR, GROUNDED, PROMPTS, WARM_UP
from ._common import (
    DRAFT_TOKENS_WHY,
    MAX_DRAFT_TOKENS,
    MAX_TOKENS,
    CliError,
    Parser,
    Progress,
    integer,
    max_tokens,
    num_draft_tokens,
    prefer_mlx_attention,
    run,
    seed,
)

SHOWN = {"input-grounded": GROUNDED[1], "open": PROMPTS[0]}
"""The prompts streamed and measured, named as ``mlx-spec bench`` names their workloads: a class
whose methods repeat a pattern, short enough to read, and the start of a function."""
TEMPS = (0.0, 0.8)
REPEATS = 5
"""How many times the table measures each method on each prompt by default, in passes over the
methods whose order turns by one each time (:func:`mlx_spec.bench.measure`), so that a busy
moment of the machine weighs on no method alone: five give a median, and a range that shows the
noise."""
MAX_REPEATS = 50
"""The most ``--repeats``: with the five methods, two prompts and two temperatures, 1,000 runs."""


def setup_arg_parser() -> Parser:
    """The parser of ``mlx-spec demo``."""
    parser = Parser(
        prog="mlx-spec demo",
        description=(
            "On the tiny model pair shipped with mlx-spec, streams completions of an "
            "input-grounded prompt (text the output repeats) and of an open prompt at "
            "temperature 0 and 0.8, drafting with the draft model, with prompt lookup and with "
            "the target's MTP head, and marks the draft tokens the target accepted; then "
            "measures plain decoding, mlx-lm's speculative decoding and mlx-spec with each "
            "drafter on the same prompts."
        ),
    )
    parser.add_argument(
        "--max-tokens",
        type=max_tokens,
        default=48,
        help=f"tokens per completion and per measured generation, 1 to {MAX_TOKENS} (default: 48)",
    )
    parser.add_argument(
        "--num-draft-tokens",
        "-n",
        type=num_draft_tokens,
        default=8,
        help=(
            f"the most draft tokens a round, 1 to {MAX_DRAFT_TOKENS} ({DRAFT_TOKENS_WHY}); each "
            "round drafts the number that pays most, measured as it runs, unless --fixed; "
            "mlx-lm's loop drafts as its command does, at most this many (default: 8)"
        ),
    )
    parser.add_argument(
        "--fixed",
        action="store_true",
        help="draft exactly --num-draft-tokens every round, mlx-lm's loop too",
    )
    parser.add_argument(
        "--repeats",
        type=integer(2, MAX_REPEATS, " (a range needs two runs)"),
        default=REPEATS,
        help=(
            f"times the table measures each method on each prompt, 2 to {MAX_REPEATS}: fewer "
            f"finish sooner, more give a steadier median (default: {REPEATS})"
        ),
    )
    parser.add_argument(
        "--seed",
        type=seed,
        default=0,
        help=(
            "random seed of the streamed completions, 0 to 2**64 - 1; with adaptive draft "
            "lengths it reproduces the distribution of the text, not the text (default: 0)"
        ),
    )
    parser.add_argument(
        "--color",
        choices=("auto", "always", "never"),
        default="auto",
        help="colour accepted draft tokens (auto: when stdout is a terminal; else [brackets])",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs ``mlx-spec demo``; returns the exit status (0, or 2 after a one-line error)."""
    return run(setup_arg_parser(), _demo, argv)


class _Marker:
    """Writes streamed text, marking the runs of accepted draft tokens."""

    def __init__(self, color: bool) -> None:
        self.open, self.close = ("\x1b[32m", "\x1b[0m") if color else ("[", "]")
        self.inside = False

    def write(self, text: str, from_draft: bool) -> None:
        if from_draft != self.inside and text:
            sys.stdout.write(self.open if from_draft else self.close)
            self.inside = from_draft
        sys.stdout.write(text)
        sys.stdout.flush()

    def end(self) -> None:
        if self.inside:
            sys.stdout.write(self.close)
            self.inside = False
        sys.stdout.write("\n")


def _demo(args: argparse.Namespace) -> int:
    prefer_mlx_attention()
    import mlx.core as mx

    from .. import bench
    from ..mtp import head_of

    for role in ("target", "draft"):
        if not (DEMO_DIR / role / "config.json").is_file():
            raise CliError(
                f"the shipped {role} model is missing from {DEMO_DIR / role}; reinstall "
                "mlx-spec from a full checkout (pip install -e '.[lm]')"
            )
    color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty())
    start = time.perf_counter()
    n, adaptive = args.num_draft_tokens, not args.fixed
    target, draft, tokenizer = bench.load_demo_pair()
    print(
        f"mlx-spec demo: {_describe(target, 'target')} and {_describe(draft, 'draft')}, "
        f"{_dtypes(target, draft)}, sharing one {len(tokenizer.get_vocab())}-token tokenizer; "
        f"trained on Python's own docs and source (shipped in {DEMO_DIR}). "
        f"MLX {mx.__version__} on {mx.default_device()}."
    )
    lm_n = n if args.fixed else min(n, _mlx_lm_default_n())
    has_head = head_of(target) is not None
    compared = [
        bench.plain(target),
        bench.mlx_lm(target, draft, lm_n),
        bench.mlx_spec(target, n, draft=draft, adaptive=adaptive),
        bench.mlx_spec(target, n, drafter="prompt-lookup", adaptive=adaptive),
    ]
    if has_head:
        compared.append(bench.mlx_spec(target, n, drafter="mtp", adaptive=adaptive))
    bench.warm_up(compared, mx.array(tokenizer.encode(WARM_UP)), TEMPS)
    length = f"N adaptive, at most {n}" if adaptive else f"N = {n}, fixed"
    how = (
        "each round drafts as many tokens as pay, from the acceptance so far and the measured "
        "cost of a round, and none when prompt lookup finds no match; --fixed drafts N"
        if adaptive
        else f"the draft model{' and the MTP head' if has_head else ''} draft {n} tokens a "
        f"round, prompt lookup up to {n} (what follows the match, none without one)"
    )
    mtp = (
        ", or from the target's own MTP head (a layer trained to predict the token after next "
        "from the target's last hidden state)"
        if has_head
        else ""
    )
    print(
        "\nDrafts come from the draft model, or from prompt lookup (no second model: it finds "
        f"the text's last tokens earlier in the text and proposes what followed them){mtp}. "
        f"{length}: {how}."
    )
    legend = "in green" if color else "in [brackets]"
    print(f"Draft tokens the target accepted are shown {legend}; the rest are the target's own.")
    drafters = {
        "draft model": {"draft_model": draft},
        "prompt lookup": {"drafter": "prompt-lookup"},
    }
    if has_head:
        drafters["MTP head"] = {"drafter": "mtp"}
    for workload, text in SHOWN.items():
        print(f"\n=== {workload} prompt ===\n{text}")
        for temp in TEMPS:
            for name, options in drafters.items():
                print(f"--- {workload}, temperature {temp}, {name}, {length} ---")
                _stream(target, tokenizer, text, temp, args, color, options)

    print(
        f"\nMeasuring {len(compared)} methods on each prompt at each temperature, {args.repeats} "
        f"times, interleaved, at {args.max_tokens} tokens (seed 0; the first time twice in a "
        "row: first use, steady state); progress on stderr.",
        flush=True,
    )
    workloads = {k: [mx.array(tokenizer.encode(v))] for k, v in SHOWN.items()}
    progress = Progress()
    rows = bench.measure(
        compared, workloads, TEMPS, args.max_tokens, repeats=args.repeats, on_run=progress
    )
    progress.done()
    lines = bench.summarize(rows)
    print(f"\n{bench.table(lines)}")
    lm_n_why = "" if args.fixed else " (its command's default, at most -n)"
    kinds, withs = (
        ("draft, lookup, mtp", ", with the MTP head") if has_head else ("draft, lookup", "")
    )
    print(
        f"\nplain: mlx_lm.generate.generate_step. mlx-lm N={lm_n}: mlx-lm's speculative decoding "
        f"with the draft model{lm_n_why}. {kinds}: mlx-spec with the draft model, with prompt "
        f"lookup{withs}.\ntok/s: the median of the {args.repeats} steady runs (all but the first "
        "run's first time), and in brackets their range; first-use time / steady: the first "
        "time over a steady run's. tok/round: tokens per target call.\nx plain: tok/s over "
        "plain decoding's on the same prompt at the same temperature, run by run: the median and "
        "the range; x mlx-lm: of the medians. '-': no such comparison."
    )
    print(f"\n{bench.report(lines)}")
    print(f"\nDemo done in {time.perf_counter() - start:.0f} s. Next: mlx-spec bench --quick")
    return 0


def _stream(
    target: Any,
    tokenizer: Any,
    text: str,
    temp: float,
    args: argparse.Namespace,
    color: bool,
    options: dict[str, Any],
) -> None:
    """Streams one completion of ``text`` with mlx-spec, drafting as ``options`` say (a draft
    model or a drafter), marking the accepted draft tokens; then its counts."""
    import mlx.core as mx

    from ..generation import SpeculativeStats, stream_generate
    from ..sampling import make_sampler

    marker = _Marker(color)
    stats = SpeculativeStats()
    for response in stream_generate(
        target,
        tokenizer,
        text,
        max_tokens=args.max_tokens,
        sampler=make_sampler(temp=temp),
        num_draft_tokens=args.num_draft_tokens,
        adaptive=not args.fixed,
        key=mx.random.key(args.seed),
        stats=stats,
        **options,
    ):
        marker.write(response.text, response.from_draft)
    marker.end()
    print(
        f"--- {stats.generated} tokens in {stats.rounds} rounds, {stats.accepted} of "
        f"{stats.drafted} draft tokens accepted, {stats.tokens_per_round:.2f} tokens per round ---"
    )


def _mlx_lm_default_n() -> int:
    """The draft length of the ``mlx_lm.generate`` command when none is given, from its public
    parser (the module, which ``mlx_lm.generate`` the function hides)."""
    import importlib

    command = importlib.import_module("mlx_lm.generate")
    return command.setup_arg_parser().get_default("num_draft_tokens")


def _parameters(model: Any) -> list[Any]:
    from mlx.utils import tree_flatten

    return [p for _, p in tree_flatten(model.parameters())]


def _describe(model: Any, role: str) -> str:
    """``a 6-layer, 384-wide target (10.1M parameters)``, read from the loaded model."""
    size = sum(p.size for p in _parameters(model))
    layers, width = model.args.num_hidden_layers, model.args.hidden_size
    return f"a {layers}-layer, {width}-wide {role} ({size / 1e6:.1f}M parameters)"


def _dtypes(*models: Any) -> str:
    """The parameters' dtypes, such as ``bfloat16``."""
    names = {str(p.dtype).removeprefix("mlx.core.") for m in models for p in _parameters(m)}
    return ", ".join(sorted(names))
