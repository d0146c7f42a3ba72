"""What the commands share: the parser, option values, and turning a failure into one line.

Nothing here imports MLX or mlx-lm, so ``--help`` and a bad option answer at once.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn


class CliError(Exception):
    """A problem the user can fix; printed as one line, exit status 2."""


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (what is wrong, where to look), status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def run(
    parser: argparse.ArgumentParser,
    body: Callable[[argparse.Namespace], int],
    argv: Sequence[str] | None,
    *,
    extra: str = "lm",
) -> int:
    """Parses ``argv`` with ``parser`` and runs ``body`` on the result.

    Args:
        parser (ArgumentParser): the command's parser; its ``prog`` starts each error line.
        body (callable): the command, given the parsed arguments; returns the exit status.
        argv (sequence of str, optional): the arguments. Default: ``sys.argv[1:]``.
        extra (str, optional): the pip extra that installs what ``body`` imports. Default:
            ``"lm"``.

    Returns:
        int: ``body``'s exit status; 2 after a one-line error on stderr (a :class:`CliError`, or
        a missing dependency); 130 after Ctrl-C.
    """
    args = parser.parse_args(argv)
    try:
        return body(args)
    except CliError as error:
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return 2
    except ImportError as error:
        print(
            f"{parser.prog}: error: {error}; install it with pip install 'mlx-spec[{extra}]'",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


# -- option values -----------------------------------------------------------------------------


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def temperature(text: str) -> float:
    """A sampling temperature: a finite number ``>= 0``."""
    value = _number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (0 is greedy), got {text}")
    return value


def fraction(text: str) -> float:
    """A probability threshold: a number in ``[0, 1]``."""
    value = _number(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1] (0 turns it off), got {text}")
    return value


def integer(least: int, hint: str = "") -> Callable[[str], int]:
    """A parser of integers ``>= least``; ``hint`` follows the bound in its error."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be >= {least}{hint}, got {text}")
        return value

    return parse
