"""``mlx-spec generate``: speculative generation with any mlx-lm model, streamed.

Drafts come from a draft model (``--draft-model``, same tokenizer as the target), from prompt
lookup (``--prompt-lookup``, no second model) or from the target's own MTP head (``--mtp``, added
to its folder by ``mlx-spec convert-mtp``). The models are loaded and checked before any
generation; the speculation's counts come at the end, with how often each draft position was
kept. Started by ``mlx.launch`` on several ranks, the target is split over them (mlx-lm's sharded
loading) and only rank 0 prints.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._checks import KV_BITS
from ._common import (
    DRAFT_TOKENS_WHY,
    MAX_DRAFT_TOKENS,
    MAX_TOKENS,
    CliError,
    Parser,
    fraction,
    integer,
    kv_bits,
    listing,
    max_tokens,
    num_draft_tokens,
    prefer_mlx_attention,
    prompt_text,
    run,
    seed,
    shown,
    temperature,
    utf8_text,
)

if TYPE_CHECKING:
    from ..loop import SpeculativeStats


def setup_arg_parser() -> Parser:
    """The parser of ``mlx-spec generate``."""
    parser = Parser(
        prog="mlx-spec generate",
        description=(
            "Speculative generation with any mlx-lm model, streamed: drafts come from a draft "
            "model that shares the target's tokenizer, from prompt lookup (no second model), or "
            "from the target's own MTP head. The output has exactly the target's distribution "
            "under the given sampler; the speculation's counts come at the end. Started by "
            "mlx.launch on several ranks, the target is split over them and only rank 0 prints."
        ),
    )
    parser.add_argument(
        "--model",
        type=utf8_text,
        required=True,
        help="target: a local mlx-lm folder or a name mlx-lm resolves",
    )
    drafts = parser.add_mutually_exclusive_group(required=True)
    drafts.add_argument(
        "--draft-model",
        type=utf8_text,
        help="draft model sharing the target's tokenizer",
    )
    drafts.add_argument(
        "--prompt-lookup",
        action="store_true",
        help="draft by prompt lookup (n-gram matches in the prompt and the text so far), no model",
    )
    drafts.add_argument(
        "--mtp",
        action="store_true",
        help=(
            "draft with the target's own multi-token prediction (MTP) head, no second model: "
            "Qwen3-Next, Qwen3.5 / 3.6, DeepSeek-V3 and GLM-4.5 ship one, which `mlx-spec "
            "convert-mtp HF_DIR MLX_DIR` adds to an MLX folder (one process only)"
        ),
    )
    parser.add_argument(
        "--prompt", type=prompt_text, required=True, help="the prompt text (UTF-8, not empty)"
    )
    parser.add_argument(
        "--temp", type=temperature, default=0.0, help="temperature, >= 0; 0 is greedy"
    )
    parser.add_argument(
        "--top-p", type=fraction, default=0.0, help="nucleus mass in [0, 1]; 0 or 1 is off"
    )
    parser.add_argument(
        "--top-k",
        type=integer(0, why=" (0 is off)"),
        default=0,
        help="keep the top k; 0, or k at least the vocabulary size, keeps every token",
    )
    parser.add_argument("--min-p", type=fraction, default=0.0, help="min-p in [0, 1]; 0 is off")
    parser.add_argument(
        "--num-draft-tokens",
        "-n",
        type=num_draft_tokens,
        default=8,
        help=(
            f"the most draft tokens a round, 1 to {MAX_DRAFT_TOKENS} ({DRAFT_TOKENS_WHY}); each "
            "round asks for the number that pays most, measured as it runs, unless --fixed; "
            "prompt lookup proposes fewer where its match ends sooner, and none without a match "
            "(default: 8)"
        ),
    )
    parser.add_argument(
        "--fixed",
        action="store_true",
        help="ask for --num-draft-tokens every round (mlx-lm's behaviour)",
    )
    parser.add_argument(
        "--acceptance",
        choices=("coupled", "residual"),
        default="coupled",
        help=(
            "how a sampled draft token is kept: coupled, when the target's own draw at its "
            "position (noise fixed by the seed and the position) equals it, so that the text is "
            "mlx-lm's for the seed whatever the drafter and N; or residual, rejection sampling, "
            "which keeps more of a draft model's tokens where distributions are flat and gives "
            "other text for a seed, the same only with --fixed (default: coupled)"
        ),
    )
    parser.add_argument(
        "--max-tokens",
        "-m",
        type=max_tokens,
        default=256,
        help=f"tokens to generate, 1 to {MAX_TOKENS} (default: 256)",
    )
    parser.add_argument(
        "--seed",
        type=seed,
        default=None,
        help="random seed, 0 to 2**64 - 1 (default: a fresh one)",
    )
    parser.add_argument(
        "--max-kv-size",
        type=integer(1),
        default=None,
        help=(
            "rotating caches of this many tokens for models without their own (mlx-lm's option; "
            "not with --kv-bits)"
        ),
    )
    parser.add_argument(
        "--kv-bits",
        type=kv_bits,
        default=None,
        help=(
            f"quantize the caches to this many bits, {listing(KV_BITS)} (mlx-lm's option; not "
            "with --max-kv-size: mlx-lm has no quantized rotating cache)"
        ),
    )
    parser.add_argument(
        "--pipeline",
        action="store_true",
        help="under mlx.launch, split the target into stages of layers instead of each layer",
    )
    parser.add_argument(
        "--ignore-chat-template",
        action="store_true",
        help="use the prompt as it is, even when the tokenizer has a chat template",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs ``mlx-spec generate``; returns the exit status (0, or 2 after a one-line error)."""
    return run(setup_arg_parser(), _generate, argv)


def _check_options(args: argparse.Namespace) -> None:
    """Refuses options that do not combine, before anything is loaded."""
    if args.kv_bits is not None and args.max_kv_size is not None:
        raise CliError(
            "--kv-bits and --max-kv-size do not combine: mlx-lm has no quantized rotating cache; "
            "give one of them"
        )


def _check_mtp(args: argparse.Namespace, ranks: int) -> None:
    """Refuses ``--mtp`` under ``mlx.launch``, before anything is loaded: a split target's heads
    are not loaded."""
    if args.mtp and ranks > 1:
        raise CliError(
            f"--mtp runs in one process, not split over {ranks} ranks; give --draft-model or "
            "--prompt-lookup under mlx.launch"
        )


# -- loading and checking a model pair --------------------------------------------------------


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


def _model_folder(name: str, role: str) -> Path | None:
    """The local folder ``name`` names, or ``None`` for a name mlx-lm resolves (``org/model``).

    Raises:
        CliError: ``name`` names a folder that is missing, holds no ``config.json`` or cannot be
            read (a name too long, no permission).
    """
    path = Path(os.path.expanduser(name))
    try:
        if path.exists():
            if not (path / "config.json").is_file():
                raise CliError(
                    f"{role} model {shown(name)} is not an mlx-lm model folder (no config.json "
                    "in it); give a folder made by mlx_lm.convert or a name such as "
                    "mlx-community/..."
                )
            return path
    except OSError as error:
        raise CliError(
            f"cannot read the {role} model folder {shown(name)} ({error.strerror}); give an "
            "existing mlx-lm model folder"
        ) from None
    if name.count("/") != 1 or name.startswith(("/", ".", "~")) or name.endswith("/"):
        # Not an ``org/model`` name either: a folder that is not there.
        raise CliError(
            f"{role} model folder not found: {shown(name)}; give an existing mlx-lm model "
            "folder (config.json, *.safetensors, tokenizer files) or a name such as "
            "mlx-community/Qwen2.5-0.5B-Instruct-4bit"
        )
    return None


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

    return _loaded(load, name, role)


def _loaded(load: Any, name: str, role: str) -> tuple[Any, Any]:
    """``load(name)`` (``mlx_lm.load``'s signature), with errors the user can act on (see
    :func:`load_model`)."""
    folder = _model_folder(name, role)
    try:
        return load(name if folder is None else str(folder))
    except Exception as error:
        raise CliError(
            f"could not load the {role} model {shown(name)} ({_first_line(error)}); give a "
            "local mlx-lm model folder, or a name mlx-lm can download on this machine"
        ) from None


def load_with_head(name: str) -> tuple[Any, Any]:
    """:func:`mlx_spec.load` of the target ``name``, which must bring its MTP head.

    Args:
        name (str): a local model folder, or a name mlx-lm resolves (``org/model``).

    Returns:
        tuple: the model, its MTP head attached, and its ``TokenizerWrapper``.

    Raises:
        CliError: what :func:`load_model` raises; the model has no MTP head (the line says how
            to add one, and why a file was left aside).
    """
    import warnings

    from ..mtp import head_of
    from ..mtp_convert import FAMILIES, FILE, load

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        model, tokenizer = _loaded(load, name, "target")
    if head_of(model) is None:
        # mlx_spec.load's own warnings ("load: ...") say why a head was not read.
        why = "".join(f" ({w.message})" for w in said if str(w.message).startswith("load: "))
        family = getattr(model, "model_type", None)
        convert = "`mlx-spec convert-mtp HF_DIR MLX_DIR`"
        how = (
            f"{family} models ship none ({convert} adds the heads of {', '.join(FAMILIES)} models)"
            if family is not None and family not in FAMILIES
            else f"add it to an MLX folder from the model's original Hugging Face checkpoint "
            f"with {convert} (it writes MLX_DIR/{FILE})"
        )
        raise CliError(
            f"the target {shown(name)} has no MTP head{why}; {how}; give --draft-model or "
            "--prompt-lookup instead"
        )
    for w in said:  # as they would have shown: through the filters
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return model, tokenizer


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


# -- the command -------------------------------------------------------------------------------

KEPT_AT_SHOWN = 8
"""The most draft positions :func:`kept_at` lists, so that its line stays short."""


def kept_at(stats: SpeculativeStats) -> str:
    """How often each draft position was kept, as one line: ``Kept at draft position 1, 2, 3:
    81%, 64%, 40%`` (of the rounds that drafted a token there; the first
    :data:`KEPT_AT_SHOWN` positions).

    Args:
        stats (SpeculativeStats): the counts of a generation that drafted.

    Returns:
        str: the line, without a newline.
    """
    rates = stats.acceptance_at[:KEPT_AT_SHOWN]
    positions = ", ".join(str(i) for i in range(1, len(rates) + 1))
    more = len(stats.acceptance_at) - len(rates)
    rest = f" (and {more} later positions)" if more else ""
    return f"Kept at draft position {positions}: {', '.join(f'{r:.0%}' for r in rates)}{rest}"


def _generate(args: argparse.Namespace) -> int:
    _check_options(args)
    # Imported after the options are checked: mlx is slow to import, and --help should not wait.
    import mlx.core as mx

    from ..distributed import fresh_seed, load_sharded

    prefer_mlx_attention()
    group = mx.distributed.init()
    _check_mtp(args, group.size())
    # Under mlx.launch every rank runs this; the others print nothing.
    speak = group.rank() == 0
    folder = _model_folder(args.model, "target")
    if args.mtp:
        target, tokenizer = load_with_head(args.model)
    elif group.size() > 1:
        try:
            target, tokenizer = load_sharded(
                args.model if folder is None else folder, group, pipeline=args.pipeline
            )
        except Exception as error:
            raise CliError(
                f"could not split the target {shown(args.model)} over {group.size()} ranks "
                f"({_first_line(error)})"
            ) from None
    else:
        target, tokenizer = load_model(args.model, "target")
    options: dict[str, Any] = {"drafter": "mtp" if args.mtp else "prompt-lookup"}
    if args.draft_model is not None:
        draft, draft_tokenizer = load_model(args.draft_model, "draft")
        check_pair(tokenizer, draft_tokenizer)
        options = {"draft_model": draft}
    from ..generation import SpeculativeStats, stream_generate
    from ..sampling import make_sampler

    prompt = args.prompt
    if not args.ignore_chat_template and getattr(tokenizer, "chat_template", None):
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
    key_seed = args.seed if args.seed is not None else fresh_seed(group)
    sampler = make_sampler(temp=args.temp, top_p=args.top_p, min_p=args.min_p, top_k=args.top_k)
    stats = SpeculativeStats()
    response = None
    try:
        for response in stream_generate(
            target,
            tokenizer,
            prompt,
            max_tokens=args.max_tokens,
            sampler=sampler,
            num_draft_tokens=args.num_draft_tokens,
            adaptive=not args.fixed,
            acceptance=args.acceptance,
            max_kv_size=args.max_kv_size,
            kv_bits=args.kv_bits,
            key=mx.random.key(key_seed),
            stats=stats,
            **options,
        ):
            if speak:
                print(response.text, end="", flush=True)
    except ValueError as error:
        raise CliError(str(error)) from None
    if not speak:
        return 0
    print()
    print("=" * 10)
    if response is not None:
        print(f"Prompt: {response.prompt_tokens} tokens, {response.prompt_tps:.1f} tokens/s")
        print(
            f"Generation: {response.generation_tokens} tokens, "
            f"{response.generation_tps:.1f} tokens/s ({response.finish_reason})"
        )
    drafter = "MTP head" if args.mtp else "prompt lookup" if args.prompt_lookup else "draft model"
    length = "fixed" if args.fixed else "adaptive, at most"
    drafts = (
        f"{stats.drafted} drafted, {stats.accepted} accepted "
        f"(acceptance rate {stats.acceptance_rate:.1%})"
        if stats.drafted
        else "nothing drafted"
    )
    # Residual text depends on the draft lengths, which adaptive lengths choose from timings.
    timed = args.acceptance == "residual" and args.temp > 0 and not args.fixed
    caveat = " (with residual acceptance, reproduces this text with --fixed only)" if timed else ""
    print(
        f"Speculation: {drafter}, N {length} {args.num_draft_tokens}, {stats.rounds} rounds, "
        f"{drafts}, {stats.tokens_per_round:.2f} tokens per round; seed {key_seed}{caveat}"
    )
    if stats.drafted:
        print(kept_at(stats))
    return 0
