"""The ``mlx-spec`` command (also ``python -m mlx_spec``): ``demo``, ``generate`` and ``bench``.

- ``mlx-spec demo``: the shipped model pair streams a few completions with the accepted draft
  tokens marked, then a table compares plain decoding, mlx-lm's speculative decoding and mlx-spec.
- ``mlx-spec generate --model M --draft-model D --prompt P``: any mlx-lm pair, streamed, with
  the speculation's counts at the end.
- ``mlx-spec bench [--out DIR] [--quick]``: the acceptance and generation benchmarks, written to
  ``results.json`` and two PNG plots.

Errors are one line on stderr saying what to do, with exit status 2. mlx-lm (and matplotlib for
``bench``) is imported only once the arguments are checked, so ``--help`` and bad options answer
at once.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from ._demo import DEMO_DIR, PROMPTS

DEMO_PROMPTS = tuple(zip(("code", "prose"), PROMPTS[:2], strict=True))
DEMO_TEMPS = (0.0, 0.8)


class CliError(Exception):
    """A problem the user can fix; printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (what is wrong, where to look), status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


# -- option values -----------------------------------------------------------------------------


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def _temperature(text: str) -> float:
    value = _float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (0 is greedy), got {text}")
    return value


def _fraction(text: str) -> float:
    value = _float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1] (0 turns it off), got {text}")
    return value


def _integer(least: int, hint: str = "") -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be >= {least}{hint}, got {text}")
        return value

    return parse


def _add_sampling(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--temp", type=_temperature, default=0.0, help="temperature, >= 0; 0 is greedy"
    )
    parser.add_argument(
        "--top-p", type=_fraction, default=0.0, help="nucleus mass in [0, 1]; 0 or 1 is off"
    )
    parser.add_argument(
        "--top-k", type=_integer(0, " (0 is off)"), default=0, help="keep the top k; 0 is off"
    )
    parser.add_argument("--min-p", type=_fraction, default=0.0, help="min-p in [0, 1]; 0 is off")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="mlx-spec",
        description="Lossless speculative decoding for MLX and mlx-lm.",
        epilog="Run 'mlx-spec demo' first: it needs no download.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = commands.add_parser(
        "demo",
        help="see speculative decoding on the shipped model pair (no download)",
        description=(
            "Streams completions of a code and a prose prompt at temperature 0 and 0.8 on the "
            "tiny model pair shipped with mlx-spec, marking the draft tokens the target "
            "accepted, then measures plain decoding, mlx-lm's speculative decoding and "
            "mlx-spec on the same prompts and seeds."
        ),
    )
    demo.add_argument(
        "--max-tokens",
        type=_integer(1),
        default=64,
        help="tokens per completion and per measured generation (default: 64)",
    )
    demo.add_argument(
        "--num-draft-tokens",
        "-n",
        type=_integer(1),
        default=None,
        help="draft tokens per round (default: the fastest of 1 to 4, measured on this machine)",
    )
    demo.add_argument("--seed", type=_integer(0), default=0, help="random seed (default: 0)")
    demo.add_argument(
        "--color",
        choices=("auto", "always", "never"),
        default="auto",
        help="colour accepted draft tokens (auto: when stdout is a terminal; else [brackets])",
    )
    demo.set_defaults(run=_demo)

    gen = commands.add_parser(
        "generate",
        help="generate with any mlx-lm model pair",
        description=(
            "Speculative generation with a target and a draft model that share a tokenizer, "
            "streamed; the speculation's counts come at the end. The output has exactly the "
            "target's distribution under the given sampler."
        ),
    )
    gen.add_argument(
        "--model", required=True, help="target: a local mlx-lm folder or a name mlx-lm resolves"
    )
    gen.add_argument(
        "--draft-model", required=True, help="draft model sharing the target's tokenizer"
    )
    gen.add_argument("--prompt", required=True, help="the prompt text")
    _add_sampling(gen)
    gen.add_argument(
        "--num-draft-tokens", "-n", type=_integer(1), default=2, help="draft tokens per round"
    )
    gen.add_argument("--max-tokens", "-m", type=_integer(1), default=256, help="tokens to generate")
    gen.add_argument(
        "--seed", type=_integer(0), default=None, help="random seed (default: a fresh one)"
    )
    gen.add_argument(
        "--ignore-chat-template",
        action="store_true",
        help="use the prompt as it is, even when the tokenizer has a chat template",
    )
    gen.set_defaults(run=_generate)

    bench = commands.add_parser(
        "bench",
        help="run the benchmarks: results.json, PNG plots and tables",
        description=(
            "Times one verification step (mlx-spec's acceptance against its floor and mlx-lm's "
            "verification) over vocabulary sizes, and generation on the shipped pair (tokens "
            "per round and per second of mlx-spec, mlx-lm's speculative loop and plain "
            "decoding) over temperatures; writes results.json, acceptance.png and "
            "generation.png, and prints the tables."
        ),
    )
    bench.add_argument(
        "--out",
        type=Path,
        default=Path("bench-out"),
        help="output folder (default: ./bench-out)",
    )
    bench.add_argument(
        "--quick", action="store_true", help="fewer settings: under a minute on two CPU cores"
    )
    bench.set_defaults(run=_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the ``mlx-spec`` command.

    Args:
        argv (sequence of str, optional): the arguments. Default: ``sys.argv[1:]``.

    Returns:
        int: the exit status: 0, or 2 after a one-line error on stderr.
    """
    args = _parser().parse_args(argv)
    try:
        return args.run(args)
    except CliError as error:
        print(f"mlx-spec {args.command}: error: {error}", file=sys.stderr)
        return 2
    except ImportError as error:
        extra = "bench" if args.command == "bench" else "lm"
        print(
            f"mlx-spec {args.command}: error: {error}; install it with "
            f"pip install 'mlx-spec[{extra}]'",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


# -- loading and checking a model pair --------------------------------------------------------


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


def load_model(name: str, role: str) -> tuple[Any, Any]:
    """``mlx_lm.load(name)``, with errors the user can act on.

    Args:
        name (str): a local model folder, or a name mlx-lm resolves (``org/model``).
        role (str): ``"target"`` or ``"draft"``, for the messages.

    Returns:
        tuple: the model and its ``TokenizerWrapper``.

    Raises:
        CliError: the folder is missing or not a model folder, or mlx-lm cannot load it.
    """
    from mlx_lm import load

    path = Path(name).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise CliError(
                f"{role} model {name!r} is not an mlx-lm model folder (no config.json in it); "
                "give a folder made by mlx_lm.convert or a name such as mlx-community/..."
            )
    elif name.count("/") != 1 or name.startswith(("/", ".", "~")) or name.endswith("/"):
        # Not an ``org/model`` name either: a folder that is not there.
        raise CliError(
            f"{role} model folder not found: {name!r}; give an existing mlx-lm model folder "
            "(config.json, *.safetensors, tokenizer files) or a name such as "
            "mlx-community/Qwen2.5-0.5B-Instruct-4bit"
        )
    try:
        return load(str(path) if path.exists() else name)
    except Exception as error:
        raise CliError(
            f"could not load the {role} model {name!r} ({_first_line(error)}); give a local "
            "mlx-lm model folder, or a name mlx-lm can download on this machine"
        ) from None


def check_pair(tokenizer: Any, draft_tokenizer: Any) -> None:
    """Raises :class:`CliError` unless target and draft tokenize the same way (same ids)."""
    target_vocab, draft_vocab = tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    advice = "use a draft of the same model family, made with the target's tokenizer"
    if len(target_vocab) != len(draft_vocab):
        raise CliError(
            f"the target's tokenizer has {len(target_vocab)} tokens and the draft's "
            f"{len(draft_vocab)}: the vocabulary sizes differ; {advice}"
        )
    if target_vocab != draft_vocab:
        differ = sum(draft_vocab.get(token) != i for token, i in target_vocab.items())
        raise CliError(
            f"the target and the draft have different tokenizers ({differ} of "
            f"{len(target_vocab)} tokens have other ids); {advice}"
        )


def check_caches(target: Any, draft: Any) -> None:
    """Raises :class:`CliError` when either model's KV cache cannot be trimmed."""
    from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache

    for role, model in (("target", target), ("draft", draft)):
        cache = make_prompt_cache(model)
        if not can_trim_prompt_cache(cache):
            kinds = sorted({type(c).__name__ for c in cache if not c.is_trimmable()})
            raise CliError(
                f"the {role} model's cache cannot be trimmed ({', '.join(kinds)}): speculative "
                "decoding rewinds both caches after each round; use models with an attention "
                "KV cache (not recurrent or state-space layers)"
            )


# -- mlx-spec generate -------------------------------------------------------------------------


def _generate(args: argparse.Namespace) -> int:
    import mlx.core as mx

    from .generation import SpeculativeStats, stream_generate
    from .sampling import make_sampler

    target, tokenizer = load_model(args.model, "target")
    draft, draft_tokenizer = load_model(args.draft_model, "draft")
    check_pair(tokenizer, draft_tokenizer)
    check_caches(target, draft)
    prompt = args.prompt
    if not args.ignore_chat_template and getattr(tokenizer, "chat_template", None):
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    sampler = make_sampler(temp=args.temp, top_p=args.top_p, min_p=args.min_p, top_k=args.top_k)
    stats = SpeculativeStats()
    response = None
    try:
        for response in stream_generate(
            target,
            tokenizer,
            prompt,
            max_tokens=args.max_tokens,
            draft_model=draft,
            sampler=sampler,
            num_draft_tokens=args.num_draft_tokens,
            key=mx.random.key(seed),
            stats=stats,
        ):
            print(response.text, end="", flush=True)
    except ValueError as error:
        raise CliError(str(error)) from None
    print()
    print("=" * 10)
    if response is not None:
        print(f"Prompt: {response.prompt_tokens} tokens, {response.prompt_tps:.1f} tokens/s")
        print(
            f"Generation: {response.generation_tokens} tokens, "
            f"{response.generation_tps:.1f} tokens/s ({response.finish_reason})"
        )
    print(
        f"Speculation: N = {args.num_draft_tokens}, {stats.rounds} rounds, "
        f"{stats.drafted} drafted, {stats.accepted} accepted "
        f"(acceptance rate {stats.acceptance_rate:.1%}), "
        f"{stats.tokens_per_round:.2f} tokens per round; seed {seed}"
    )
    return 0


# -- mlx-spec demo -----------------------------------------------------------------------------


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

    from . import bench
    from .generation import SpeculativeStats, stream_generate
    from .sampling import make_sampler

    for role in ("target", "draft"):
        if not (DEMO_DIR / role / "config.json").is_file():
            raise CliError(
                f"the shipped {role} model is missing from {DEMO_DIR / role}; reinstall "
                "mlx-spec from a full checkout (pip install -e '.[lm]')"
            )
    color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty())
    start = time.perf_counter()
    target, draft, tokenizer = bench.load_demo_pair()
    prompts = [(label, text, mx.array(tokenizer.encode(text))) for label, text in DEMO_PROMPTS]
    print(
        "mlx-spec demo: a 6-layer target (10.1M parameters) and a 1-layer draft (1.2M), "
        "bfloat16, sharing one 4096-token tokenizer; trained on Python's own docs and source "
        f"(shipped in {DEMO_DIR}). MLX {mx.__version__} on {mx.default_device()}."
    )
    bench.warm_up(target, draft, prompts[0][2])
    if args.num_draft_tokens is None:
        calibration = [mx.array(tokenizer.encode(p)) for p in PROMPTS[2:]]
        n, speeds = bench.choose_num_draft_tokens(target, draft, calibration, DEMO_TEMPS)
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
        for temp in DEMO_TEMPS:
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
    rows = _demo_rows(bench, target, draft, [p for _, _, p in prompts], n, args)
    print()
    print(_demo_table(rows, n))
    print(
        "tokens/round: tokens per target call (plain decoding: 1). acceptance: draft tokens "
        "kept / drafted. vs plain: tokens/s against plain decoding at the same temperature; "
        "below 1.00x speculation did not pay on this machine in this run."
    )
    print(f"\nDemo done in {time.perf_counter() - start:.0f} s. Next: mlx-spec bench --quick")
    return 0


def _demo_rows(
    bench: Any, target: Any, draft: Any, prompts: list[Any], n: int, args: argparse.Namespace
) -> list[tuple[float, str, Any]]:
    rows = []
    for temp in DEMO_TEMPS:
        plain, theirs, ours = bench.Tally(), bench.Tally(), bench.Tally()
        for i, prompt in enumerate(prompts * 2):
            seed = args.seed + i
            plain += bench.run_plain(prompt, target, temp, seed, args.max_tokens)
            theirs += bench.run_mlx_lm(prompt, target, draft, n, temp, seed, args.max_tokens)
            ours += bench.run_mlx_spec(prompt, target, draft, n, temp, seed, args.max_tokens)
        rows += [
            (temp, "plain decoding (mlx-lm generate_step)", plain),
            (temp, "mlx-lm speculative decoding", theirs),
            (temp, "mlx-spec", ours),
        ]
    return rows


def _demo_table(rows: list[tuple[float, str, Any]], n: int) -> str:
    lines = [
        f"| temp | method (N = {n}) | tokens/s | vs plain | tokens/round | acceptance |",
        "|---|---|---|---|---|---|",
    ]
    plain_tps = {temp: t.tokens_per_second for temp, name, t in rows if name.startswith("plain")}
    for temp, name, t in rows:
        rate = "-" if t.acceptance_rate is None else f"{t.acceptance_rate:.1%}"
        lines.append(
            f"| {temp:.1f} | {name} | {t.tokens_per_second:.1f} | "
            f"{t.tokens_per_second / plain_tps[temp]:.2f}x | {t.tokens_per_round:.2f} | {rate} |"
        )
    return "\n".join(lines)


# -- mlx-spec bench ----------------------------------------------------------------------------


def _bench(args: argparse.Namespace) -> int:
    from . import bench

    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise CliError(
            "the plots need matplotlib: pip install 'mlx-spec[bench]' (or pip install matplotlib)"
        ) from None
    out = args.out
    if out.exists() and not out.is_dir():
        raise CliError(f"--out {str(out)!r} is a file; give a folder (it is created if needed)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise CliError(
            f"cannot create --out {str(out)!r} ({error.strerror}); give another folder"
        ) from None
    tty = sys.stderr.isatty()

    def progress(step: int, steps: int, label: str) -> None:
        filled = round(20 * (step - 1) / steps)
        line = f"[{'#' * filled}{'.' * (20 - filled)}] {step}/{steps} {label}"
        sys.stderr.write(f"\r\x1b[K{line}" if tty else f"{line}\n")
        sys.stderr.flush()

    start = time.perf_counter()
    results = bench.run_benchmark(out, args.quick, progress)
    sys.stderr.write(f"{chr(13) + chr(27) + '[K' if tty else ''}[{'#' * 20}] done\n")
    m = results["machine"]
    print(
        f"# mlx-spec bench{' --quick' if args.quick else ''}: {m['date']}, {m['system']}, "
        f"{m['cpu_count']} cores, Python {m['python']}, MLX {m['mlx']} ({m['device']}), "
        f"mlx-lm {m['mlx_lm']}"
    )
    print(
        "\n## One verification step: median ms; 'x floor' = time / floor (max + read), "
        "'speedup' = mlx-lm / mlx-spec\n"
    )
    print(bench.acceptance_table(results["acceptance"]))
    g = results["settings"]["generation"]
    print(
        f"\n## Generation on the shipped demo pair: {len(g['prompts'])} prompts x "
        f"{g['max_tokens']} tokens per setting\n"
    )
    print(bench.generation_table(results["generation"]))
    print(f"\nWrote {out / 'results.json'}, {out / 'acceptance.png'} and {out / 'generation.png'}")
    print(f"({time.perf_counter() - start:.0f} s)")
    return 0
