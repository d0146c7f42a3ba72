"""``mlx-spec bench``: generation on the shipped pair, methods interleaved, as a table and JSON.

Plain decoding, mlx-lm's speculative decoding, and mlx-spec with the draft model, with prompt
lookup and with the target's MTP head, at fixed draft lengths and adaptive, on an input-grounded
and an open workload at temperature 0 and 0.8 (:mod:`mlx_spec.bench`), over several passes: the
table gives the median and range of each method's tokens/s and of its ratio to plain decoding, a
line says whether the machine held still enough for a verdict, and a line per drafter gives it;
with matplotlib, a plot of tokens/s against tokens per round.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ._common import CliError, Parser, Progress, run, shown, utf8_text

TEMPS = (0.0, 0.8)
SETTINGS = {
    False: {
        "drafts": (1, 2, 4, 8),
        "mtp_drafts": (1, 2, 3, 4),
        "prompts": 4,
        "max_tokens": 128,
        "repeats": 3,
    },
    True: {"drafts": (2,), "mtp_drafts": (2,), "prompts": 1, "max_tokens": 32, "repeats": 3},
}
"""The draft lengths (those of the MTP head apart: a head's chained guesses fade faster than a
draft model's), prompts per workload, tokens per generation and passes over the prompts
(:func:`mlx_spec.bench.measure`), full and ``--quick``."""
PLOT = "plot.png"
"""The plot's file in ``--out``."""


def setup_arg_parser() -> Parser:
    """The parser of ``mlx-spec bench``."""
    parser = Parser(
        prog="mlx-spec bench",
        description=(
            "Measures generation on the shipped pair: plain decoding, mlx-lm's speculative "
            "decoding, and mlx-spec with the draft model, with prompt lookup and with the "
            "target's MTP head (fixed draft lengths and adaptive), interleaved, on an "
            "input-grounded and an open workload at temperature 0 and 0.8, over several passes "
            "(the first runs each method twice: first use, steady state); writes results.json "
            "and, with matplotlib, plot.png (tokens/s against tokens per round), and prints a "
            "table of tokens/s and ratios (median and range over the passes), whether the machine "
            "was quiet enough for a verdict, and a verdict per drafter."
        ),
    )
    parser.add_argument(
        "--out",
        type=_folder,
        default=Path("bench-out"),
        help="output folder (default: ./bench-out)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="one draft length, prompt and short generations"
    )
    return parser


def _folder(text: str) -> Path:
    """A folder named in UTF-8; an empty name would be the current folder, so it is refused."""
    if not text:
        raise argparse.ArgumentTypeError("expected a folder, got ''")
    return Path(utf8_text(text))


def main(argv: Sequence[str] | None = None) -> int:
    """Runs ``mlx-spec bench``; returns the exit status (0, or 2 after a one-line error)."""
    return run(setup_arg_parser(), _bench, argv)


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


def _measure(out: Path, quick: bool, progress: Progress) -> dict[str, Any]:
    """Measures, writing ``results.json`` before the first measurement (the machine and the
    settings) and again after each row, so that a run that is interrupted or fails keeps what it
    measured; returns the results."""
    import mlx.core as mx

    from .. import bench
    from .._demo import WARM_UP

    settings = {"quick": quick, "temps": TEMPS, **SETTINGS[quick]}
    results: dict[str, Any] = {"machine": bench.machine(), "settings": settings, "generation": []}
    path = out / "results.json"

    def keep(row: dict[str, Any]) -> None:
        results["generation"].append(row)
        bench.write_json(results, path)

    bench.write_json(results, path)
    progress.note("loading the demo pair, warm-up")
    target, draft, tokenizer = bench.load_demo_pair()
    methods = bench.methods(
        target, draft, settings["drafts"], mtp_drafts=settings.get("mtp_drafts")
    )
    bench.warm_up(methods, mx.array(tokenizer.encode(WARM_UP)), TEMPS)
    workloads = bench.demo_workloads(tokenizer, settings["prompts"])
    bench.measure(
        methods,
        workloads,
        TEMPS,
        settings["max_tokens"],
        keep,
        repeats=settings["repeats"],
        on_run=progress,
    )
    return results


def _plot(lines: list[dict[str, Any]], out: Path, title: str) -> str:
    """Writes the plot into ``out``; returns what was written, or, without matplotlib, how to get
    it."""
    from .. import bench

    try:
        bench.plot(lines, out / PLOT, title)
    except ModuleNotFoundError as error:
        if (error.name or "").partition(".")[0] != "matplotlib":
            raise
        return f"pip install matplotlib gives {out / PLOT} (tokens/s against tokens per round)"
    return f"Wrote {out / PLOT}: tokens/s against tokens per round"


def _bench(args: argparse.Namespace) -> int:
    out = args.out
    _prepare(out)
    from .. import bench

    progress = Progress()
    start = time.perf_counter()
    try:
        results = _measure(out, args.quick, progress)
    except OSError as error:
        if error.filename is None:
            raise
        progress.clear()
        raise CliError(
            f"{error.strerror}: {error.filename2 or error.filename}; results.json keeps "
            "what was measured before"
        ) from None
    progress.done()
    m, s = results["machine"], results["settings"]
    command = f"mlx-spec bench{' --quick' if args.quick else ''}"
    print(
        f"# {command}: {m['date']}, {m['system']}, "
        f"{m['cpu_count']} cores, Python {m['python']}, MLX {m['mlx']} ({m['device']}), "
        f"mlx-lm {m['mlx_lm']}"
    )
    print(
        f"\n## Generation on the shipped demo pair: {s['prompts']} prompt(s) per workload x "
        f"{s['max_tokens']} tokens, {s['repeats']} repeats, methods interleaved; the first "
        "runs each method twice in a row (first use, steady state). tok/s and x plain: median "
        "(min-max) over the steady runs, x plain repeat by repeat; the other ratios of the "
        "medians\n"
    )
    lines = bench.summarize(results["generation"])
    print(bench.table(lines))
    if said := bench.report(lines):
        print(f"\n{said}")
    title = f"{command}: {m['system']}, {m['cpu_count']} cores, MLX {m['mlx']} ({m['device']})"
    print(f"\n{_plot(lines, out, title)}")
    print(f"Wrote {out / 'results.json'} ({time.perf_counter() - start:.0f} s)")
    return 0
