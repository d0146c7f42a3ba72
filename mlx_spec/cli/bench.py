"""``mlx-spec bench``: the acceptance and generation benchmarks, as tables, JSON and PNG plots."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from ._common import CliError, Parser, run, shown, utf8_text


def setup_arg_parser() -> Parser:
    """The parser of ``mlx-spec bench``."""
    parser = Parser(
        prog="mlx-spec bench",
        description=(
            "Times one verification step (mlx-spec's acceptance against its floor and mlx-lm's "
            "verification) over vocabulary sizes, and generation on the shipped pair (tokens "
            "per round and per second of mlx-spec, mlx-lm's speculative loop and plain "
            "decoding) over temperatures; writes results.json, acceptance.png and "
            "generation.png, and prints the tables."
        ),
    )
    parser.add_argument(
        "--out",
        type=_folder,
        default=Path("bench-out"),
        help="output folder (default: ./bench-out)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="fewer settings: under a minute on two CPU cores"
    )
    return parser


def _folder(text: str) -> Path:
    """A folder named in UTF-8; an empty name would be the current folder, so it is refused."""
    if not text:
        raise argparse.ArgumentTypeError("expected a folder, got ''")
    return Path(utf8_text(text))


def main(argv: Sequence[str] | None = None) -> int:
    """Runs ``mlx-spec bench``; returns the exit status (0, or 2 after a one-line error)."""
    return run(setup_arg_parser(), _bench, argv, extra="bench")


def _prepare(out: Path) -> None:
    """Creates ``out`` if needed and checks that a file can be written in it.

    Raises:
        CliError: ``out`` is a file, cannot be created (a file on its way, a name too long, no
            permission), or cannot be written in.
    """
    try:
        if out.exists() and not out.is_dir():
            raise CliError(
                f"--out {shown(str(out))} is a file; give a folder (it is created if needed)"
            )
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise CliError(
            f"cannot create --out {shown(str(out))} ({error.strerror}); give another folder"
        ) from None
    try:
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as error:
        raise CliError(
            f"cannot write in --out {shown(str(out))} ({error.strerror}); give a folder you "
            "can write"
        ) from None


def _bench(args: argparse.Namespace) -> int:
    out = args.out
    _prepare(out)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise CliError(
            "the plots need matplotlib: pip install 'mlx-spec[bench]' (or pip install matplotlib)"
        ) from None
    from .. import bench

    # On a terminal the progress bar redraws one line; elsewhere each step is a line.
    tty = sys.stderr.isatty()
    clear = "\r\x1b[K" if tty else ""

    def progress(step: int, steps: int, label: str) -> None:
        filled = round(20 * (step - 1) / steps)
        line = f"[{'#' * filled}{'.' * (20 - filled)}] {step}/{steps} {label}"
        sys.stderr.write(f"{clear}{line}" if tty else f"{line}\n")
        sys.stderr.flush()

    start = time.perf_counter()
    try:
        results = bench.run_benchmark(out, args.quick, progress)
    except OSError as error:
        if error.filename is None:
            raise
        sys.stderr.write(clear)
        raise CliError(
            f"{error.strerror}: {error.filename2 or error.filename}; results.json keeps "
            "what was measured before"
        ) from None
    sys.stderr.write(f"{clear}[{'#' * 20}] done\n")
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
