"""The ``mlx-spec`` command (also ``python -m mlx_spec``): a dispatcher to one module per command.

- ``mlx-spec demo`` (:mod:`.demo`): the shipped model pair streams completions of an
  input-grounded and an open prompt, drafting with the draft model, with prompt lookup and with
  the target's MTP head, the accepted draft tokens marked; then a table compares plain decoding,
  mlx-lm's speculative decoding and mlx-spec with each drafter.
- ``mlx-spec generate --model M (--draft-model D | --prompt-lookup | --mtp) --prompt P``
  (:mod:`.generate`): any mlx-lm model, streamed, with the speculation's counts at the end and how
  often each draft position was kept.
- ``mlx-spec bench [--out DIR] [--quick]`` (:mod:`.bench`): generation on the shipped pair,
  every method interleaved, as a table and ``results.json``.
- ``mlx-spec convert-mtp HF_DIR MLX_DIR`` (:mod:`.convert_mtp`): a model's MTP head, read from its
  original checkpoint, written into its MLX folder.
- ``mlx-spec --version``: the versions of mlx-spec, MLX and mlx-lm.

Each command module has its own parser (``setup_arg_parser``) and ``main``. Errors are one line on
stderr saying what to do, with exit status 2. mlx-lm is imported only once the arguments are
checked, so ``--help`` and bad options answer at once.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from importlib import metadata

from .. import __version__
from ._common import Parser, run

COMMANDS = {
    "demo": "see speculative decoding on the shipped model pair (no download)",
    "generate": "generate with any mlx-lm model: a draft model, prompt lookup or its MTP head",
    "bench": "measure generation on the shipped pair: a table and results.json",
    "convert-mtp": "add a model's MTP head to its MLX folder, from the original checkpoint",
}
"""Each command's name (its module here, with ``_`` for ``-``) and its line in
``mlx-spec --help``."""


def version() -> str:
    """``mlx-spec 0.1.0 (mlx 0.32.1, mlx-lm 0.32.2)``: read from the installed packages' metadata,
    so that mlx-lm is not imported."""

    def installed(name: str) -> str:
        try:
            return f"{name} {metadata.version(name)}"
        except metadata.PackageNotFoundError:
            return f"{name} not installed"

    return f"mlx-spec {__version__} ({installed('mlx')}, {installed('mlx-lm')})"


def setup_arg_parser() -> Parser:
    """The parser of the command's first word; each command parses the rest itself."""
    parser = Parser(
        prog="mlx-spec",
        description="Lossless speculative decoding for MLX and mlx-lm.",
        epilog="Run 'mlx-spec demo' first: it needs no download.",
    )
    parser.add_argument(
        "--version", action="version", version=version(), help="show the versions and exit"
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, line in COMMANDS.items():
        commands.add_parser(name, help=line, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the ``mlx-spec`` command.

    Args:
        argv (sequence of str, optional): the arguments. Default: ``sys.argv[1:]``.

    Returns:
        int: the exit status: 0, or 2 after a one-line error on stderr.
    """
    argv = list(sys.argv[1:] if argv is None else argv)

    def dispatch(args: argparse.Namespace) -> int:
        module = args.command.replace("-", "_")
        return importlib.import_module(f"{__name__}.{module}").main(argv[1:])

    return run(setup_arg_parser(), dispatch, argv[:1])
