"""What the commands share: the parser, option values, and turning a failure into one line.

Nothing here imports mlx-lm, so ``--help`` and a bad option answer at once.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from .._checks import KV_BITS
from ..draft_length import MAX_DRAFT_TOKENS


class CliError(Exception):
    """A problem the user can fix; printed as one line, exit status 2."""


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (what is wrong, where to look), status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


CLOSED_PIPE = 141
"""The exit status after the reader of the output went away (``mlx-spec ... | head``): 128 +
SIGPIPE, what a shell reports for a command that a closed pipe stopped."""


def run(
    parser: argparse.ArgumentParser,
    body: Callable[[argparse.Namespace], int],
    argv: Sequence[str] | None,
) -> int:
    """Parses ``argv`` with ``parser`` and runs ``body`` on the result.

    Args:
        parser (ArgumentParser): the command's parser; its ``prog`` starts each error line.
        body (callable): the command, given the parsed arguments; returns the exit status.
        argv (sequence of str, optional): the arguments. Default: ``sys.argv[1:]``.

    Returns:
        int: ``body``'s exit status; 2 after a one-line error on stderr (a :class:`CliError`, or
        a missing dependency); 130 after Ctrl-C; :data:`CLOSED_PIPE`, silently, once the output
        has nowhere to go.
    """
    try:
        try:
            return body(parser.parse_args(argv))
        finally:
            # Output to a pipe is buffered: a closed one may show only here, or at exit.
            sys.stdout.flush()
    except CliError as error:
        _error(parser.prog, str(error))
        return 2
    except ImportError as error:
        _error(parser.prog, f"{error}; install it with pip install 'mlx-spec[lm]'")
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:
        _drop_output()
        return CLOSED_PIPE


class Progress:
    """A measurement's progress on stderr: on a terminal one line redrawn in place, elsewhere a
    line per step, ``[#####...............] 3/24 lookup adaptive, open, t=0.8, repeat 1/3``.

    Called as ``on_run`` by :func:`mlx_spec.bench.measure`.
    """

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()

    def __call__(self, done: int, total: int, label: str) -> None:
        """Shows step ``done`` of ``total`` (counted from 1) starting: ``label``."""
        filled = round(20 * (done - 1) / total)
        self._show(f"[{'#' * filled}{'.' * (20 - filled)}] {done}/{total} {label}")

    def note(self, label: str) -> None:
        """Shows a step that is not counted, such as loading."""
        self._show(f"[{'.' * 20}] {label}")

    def done(self) -> None:
        """Ends with a full bar."""
        self._show(f"[{'#' * 20}] done")
        if self.tty:
            sys.stderr.write("\n")

    def clear(self) -> None:
        """Wipes a redrawn line, before an error message."""
        if self.tty:
            sys.stderr.write("\r\x1b[K")

    def _show(self, line: str) -> None:
        sys.stderr.write(f"\r\x1b[K{line}" if self.tty else f"{line}\n")
        sys.stderr.flush()


def prefer_mlx_attention() -> None:
    """Makes MLX's CUDA backend use its own attention kernel, unless the user chose already.

    For a call with several queries, MLX's CUDA backend builds a cuDNN graph for each new (query
    length, key length); a speculative round scores several positions against a cache one round
    longer than the last, so nearly every round of a first generation pays for a new graph
    (docs/performance.md measures both kernels). MLX reads the variable at its first attention
    call, so setting it before the models run is enough; elsewhere than on CUDA it changes
    nothing.
    """
    # Imported here: mlx_spec.attention reaches mlx-lm, which --help and bad options never need.
    from ..attention import CUDNN_ATTENTION

    os.environ.setdefault(CUDNN_ATTENTION, "0")


def _error(prog: str, message: str) -> None:
    """Prints ``prog: error: message`` on stderr as one line, however many ``message`` has."""
    print(f"{prog}: error: {' '.join(message.splitlines())}", file=sys.stderr)


def _drop_output() -> None:
    """Points stdout and stderr at the null device, so that what is left in their buffers, flushed
    at exit, goes nowhere instead of failing again."""
    null = os.open(os.devnull, os.O_WRONLY)
    for stream in (sys.stdout, sys.stderr):
        os.dup2(null, stream.fileno())
    os.close(null)


# -- option values -----------------------------------------------------------------------------

MAX_TOKENS = 1_000_000
"""The most ``--max-tokens`` takes: a bound that catches typos such as ``-m 1000000000``."""
DRAFT_TOKENS_WHY = (  # for help texts, which argparse %-formats
    "a round yields on average fewer than 1 / (1 - a) tokens for an acceptance rate a, 20 at "
    "95%%, while each draft token costs a scored position and, with a draft model, a draft step"
)
SEED_MAX = 2**64 - 1
"""The largest seed: MLX's random seeds and keys are 64-bit."""


def shown(text: str) -> str:
    """``text`` quoted for an error message, cut short when it is long."""
    return repr(text if len(text) <= 200 else f"{text[:200]}...")


def utf8_text(text: str) -> str:
    """Text as given, unless it is not UTF-8.

    Python hands the bytes of an argument that are not UTF-8 over as lone surrogates
    (``'\\udcff'``), which no tokenizer takes and no UTF-8 output can print.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raw = text[error.start : error.end].encode("utf-8", "surrogateescape")
        raise argparse.ArgumentTypeError(
            f"not UTF-8 (bytes {raw.hex(' ')} at character {error.start}); give UTF-8 text"
        ) from None
    return text


def prompt_text(text: str) -> str:
    """A prompt: UTF-8 text that is not empty (a generation continues some text)."""
    if not utf8_text(text):
        raise argparse.ArgumentTypeError(
            "is empty; give the text to continue, or the question to answer (with a chat model)"
        )
    return text


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {shown(text)}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {shown(text)}")
    return value


def temperature(text: str) -> float:
    """A sampling temperature: a finite number ``>= 0``."""
    value = _number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (0 is greedy), got {shown(text)}")
    return value


def fraction(text: str) -> float:
    """A probability threshold: a number in ``[0, 1]``."""
    value = _number(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1] (0 turns it off), got {shown(text)}")
    return value


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {shown(text)}") from None


def integer(least: int, most: int | None = None, why: str = "") -> Callable[[str], int]:
    """A parser of integers in ``[least, most]`` (``most=None``: no upper bound); ``why``
    follows the range in its error."""
    bound = f">= {least}" if most is None else f"in [{least}, {most}]"

    def parse(text: str) -> int:
        value = _integer(text)
        if value < least or (most is not None and value > most):
            raise argparse.ArgumentTypeError(f"must be {bound}{why}, got {shown(text)}")
        return value

    return parse


def listing(values: Sequence[int]) -> str:
    """``2, 3 or 4``: ``values`` as a help text or an error lists them."""
    return f"{', '.join(map(str, values[:-1]))} or {values[-1]}"


def one_of(values: Sequence[int]) -> Callable[[str], int]:
    """A parser of the integers in ``values``."""

    def parse(text: str) -> int:
        value = _integer(text)
        if value not in values:
            raise argparse.ArgumentTypeError(f"must be {listing(values)}, got {shown(text)}")
        return value

    return parse


max_tokens = integer(1, MAX_TOKENS)
num_draft_tokens = integer(1, MAX_DRAFT_TOKENS, " (see --help for why)")
seed = integer(0, SEED_MAX)
kv_bits = one_of(KV_BITS)
