"""``mlx-spec demo``: speculative decoding on the shipped model pair, with no download.

A code and a prose completion at two temperatures stream with the accepted draft tokens marked,
then a table compares plain decoding, mlx-lm's speculative decoding and mlx-spec.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Any

from .._demo import DEMO_DIR, PROMPTS, WARM_UP
from ._common import (
    DRAFT_TOKENS_WHY,
    MAX_DRAFT_TOKENS,
    MAX_TOKENS,
    SEED_MAX,
    CliError,
    Parser,
    max_tokens,
    num_draft_tokens,
    run,
    seed,
)

SHOWN = tuple(zip(("code", "prose"), PROMPTS[:2], strict=True))
"""The prompts completed on screen, labelled; the other prompts choose ``N``."""
TEMPS = (0.0, 0.8)


def setup_arg_parser() -> Parser:
    """The parser of ``mlx-spec demo``."""
    parser = Parser(
        prog="mlx-spec demo",
        description=(
            "Streams completions of a code and a prose prompt at temperature 0 and 0.8 on the "
            "tiny model pair shipped with mlx-spec, marking the draft tokens the target "
            "accepted, then measures plain decoding, mlx-lm's speculative decoding and "
            "mlx-spec on the same prompts and seeds."
        ),
    )
    parser.add_argument(
        "--max-tokens",
        type=max_tokens,
        default=64,
        help=f"tokens per completion and per measured generation, 1 to {MAX_TOKENS} (default: 64)",
    )
    parser.add_argument(
        "--num-draft-tokens",
        "-n",
        type=num_draft_tokens,
        default=None,
        help=(
            f"draft tokens per round, 1 to {MAX_DRAFT_TOKENS} ({DRAFT_TOKENS_WHY}); default: "
            "the fastest of 1 to 3, measured on this machine"
        ),
    )
    parser.add_argument(
        "--seed", type=seed, default=0, help="random seed, 0 to 2**64 - 1 (default: 0)"
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
    import mlx.core as mx

    from .. import bench
    from ..generation import SpeculativeStats, stream_generate
    from ..sampling import make_sampler

    for role in ("target", "draft"):
        if not (DEMO_DIR / role / "config.json").is_file():
            raise CliError(
                f"the shipped {role} model is missing from {DEMO_DIR / role}; reinstall "
                "mlx-spec from a full checkout (pip install -e '.[lm]')"
            )
    color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty())
    start = time.perf_counter()
    target, draft, tokenizer = bench.load_demo_pair()
    prompts = [(label, text, mx.array(tokenizer.encode(text))) for label, text in SHOWN]
    print(
        f"mlx-spec demo: {_describe(target, 'target')} and {_describe(draft, 'draft')}, "
        f"{_dtypes(target, draft)}, sharing one {len(tokenizer.get_vocab())}-token tokenizer; "
        f"trained on Python's own docs and source (shipped in {DEMO_DIR}). "
        f"MLX {mx.__version__} on {mx.default_device()}."
    )
    bench.warm_up(_compared(bench, target, draft, 2), mx.array(tokenizer.encode(WARM_UP)), TEMPS)
    if args.num_draft_tokens is None:
        calibration = [mx.array(tokenizer.encode(p)) for p in PROMPTS[len(SHOWN) :]]
        n, speeds = _fastest_n(bench, target, draft, calibration)
        measured = ", ".join(f"N={k}: {v:.0f}" for k, v in speeds.items())
        print(
            f"\nN = {n} draft tokens per round, the fastest measured here on two other prompts "
            f"at temperatures 0 and 0.8 (tokens/s {measured}). Scoring N + 1 positions costs "
            "the target more the larger N on a CPU (it is compute-bound at this size), so short "
            "drafts pay best here; on a GPU, "
            "where N + 1 positions cost about one, longer drafts win. Set it with -n."
        )
    else:
        n = args.num_draft_tokens
        print(f"\nN = {n} draft tokens per round (from --num-draft-tokens).")
    legend = "in green" if color else "in [brackets]"
    print(f"Draft tokens the target accepted are shown {legend}; the rest are the target's own.")

    for label, text, _ in prompts:
        for temp in TEMPS:
            print(f"\n--- {label} prompt, temperature {temp}, mlx-spec, N = {n} ---")
            sys.stdout.write(text)
            marker = _Marker(color)
            stats = SpeculativeStats()
            for response in stream_generate(
                target,
                tokenizer,
                text,
                max_tokens=args.max_tokens,
                draft_model=draft,
                sampler=make_sampler(temp=temp),
                num_draft_tokens=n,
                key=mx.random.key(args.seed),
                stats=stats,
            ):
                marker.write(response.text, response.from_draft)
            marker.end()
            print(
                f"--- {stats.generated} tokens in {stats.rounds} rounds, "
                f"{stats.accepted} of {stats.drafted} draft tokens accepted ---"
            )

    print(
        f"\nMeasuring: {len(prompts)} prompts x 2 seeds x {args.max_tokens} tokens per method "
        "and temperature, methods interleaved ..."
    )
    compared = _compared(bench, target, draft, n)
    rows = _rows(bench, compared, [p for _, _, p in prompts], args)
    print()
    print(_table(rows, n))
    print(
        "tokens/round: tokens per target call (plain decoding: 1). acceptance: draft tokens "
        "kept / drafted. vs plain: tokens/s against plain decoding at the same temperature; "
        "below 1.00x speculation did not pay on this machine in this run."
    )
    print(f"\nDemo done in {time.perf_counter() - start:.0f} s. Next: mlx-spec bench --quick")
    return 0


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


def _fastest_n(bench: Any, target: Any, draft: Any, prompts: list[Any]) -> tuple[int, dict]:
    """The draft length of 1 to 3 whose mlx-spec generates the most tokens per second here, on
    every prompt at each temperature (seed 100, 24 tokens), interleaved; and each one's tokens/s."""
    totals = {n: bench.Timed() for n in (1, 2, 3)}
    for prompt in prompts:
        for temp in TEMPS:
            for n in totals:
                totals[n] += bench.run(
                    bench.mlx_spec(target, n, draft=draft), prompt, temp, 100, 24
                )
    speeds = {n: t.tokens_per_second for n, t in totals.items()}
    return max(speeds, key=speeds.__getitem__), speeds


def _compared(bench: Any, target: Any, draft: Any, n: int) -> list[Any]:
    """Plain decoding, mlx-lm's speculative decoding and mlx-spec at ``n`` draft tokens."""
    return [
        bench.plain(target),
        bench.mlx_lm(target, draft, n),
        bench.mlx_spec(target, n, draft=draft),
    ]


def _rows(
    bench: Any, compared: list[Any], prompts: list[Any], args: argparse.Namespace
) -> list[tuple[float, str, Any]]:
    """Plain decoding, mlx-lm's speculative decoding and mlx-spec (``compared``, in that order),
    interleaved over the prompts, each twice with another seed, at each temperature."""
    names = ("plain decoding (mlx-lm generate_step)", "mlx-lm speculative decoding", "mlx-spec")
    rows = []
    for temp in TEMPS:
        totals = [bench.Timed() for _ in compared]
        for i, prompt in enumerate(prompts * 2):
            # MLX takes 64-bit seeds: the ones after the largest wrap around to 0.
            run_seed = (args.seed + i) & SEED_MAX
            for k, method in enumerate(compared):
                totals[k] += bench.run(method, prompt, temp, run_seed, args.max_tokens)
        rows += [(temp, name, total) for name, total in zip(names, totals, strict=True)]
    return rows


def _table(rows: list[tuple[float, str, Any]], n: int) -> str:
    lines = [
        f"| temp | method (N = {n}) | tokens/s | vs plain | tokens/round | acceptance |",
        "|---|---|---|---|---|---|",
    ]
    plain_tps = {temp: t.tokens_per_second for temp, name, t in rows if name.startswith("plain")}
    for temp, name, t in rows:
        rate = f"{t.stats.acceptance_rate:.1%}" if t.stats.drafted else "-"
        lines.append(
            f"| {temp:.1f} | {name} | {t.tokens_per_second:.1f} | "
            f"{t.tokens_per_second / plain_tps[temp]:.2f}x | {t.stats.tokens_per_round:.2f} | "
            f"{rate} |"
        )
    return "\n".join(lines)
