"""The generation benchmark at an earlier commit and at this checkout, in turn, on the same models.

What did code that is gone buy, where it is gone? This runs ``benchmarks/generation.py`` from the
tree of ``--commit`` (its ``mlx_spec``, ``benchmarks`` and ``tests``, taken with ``git archive``,
with this checkout's demo models copied in, so that both measure the same pair) and from this
checkout, alternately ``--rounds`` times, with the arguments after ``--``. ``--commit`` may also
name a directory holding those three folders of a commit (for a copy of the checkout without its
git history). Each run measures its ratios within itself, interleaved prompt by prompt; the table
sets each run's ``x plain``, ``x best fixed N`` and tokens a round of the rows whose method
contains ``--rows`` side by side.

Usage: ``python benchmarks/before.py --commit COMMIT [--rounds 2] [--rows adaptive] --
[generation.py's arguments]``.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# What a tree needs to run its own generation benchmark (which imports its tests' tiny models).
TREE = ("mlx_spec", "benchmarks", "tests")


def export(commit: str, into: Path) -> Path:
    """Writes the tree of ``commit`` that the benchmark needs (or copies it from the directory
    ``commit`` names) into ``into``, with this checkout's demo models in place of its own;
    returns ``into``."""
    if Path(commit).is_dir():
        for name in TREE:
            shutil.copytree(Path(commit) / name, into / name)
    else:
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", commit, *TREE], capture_output=True, check=False
        )
        if archive.returncode:
            raise SystemExit(f"before.py: git archive {commit} failed: {archive.stderr.decode()}")
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            tar.extractall(into, filter="data")
    shutil.rmtree(into / "mlx_spec" / "demo", ignore_errors=True)
    shutil.copytree(ROOT / "mlx_spec" / "demo", into / "mlx_spec" / "demo")
    return into


def run(tree: Path, arguments: list[str]) -> str:
    """The output of ``tree``'s generation benchmark, its ``mlx_spec`` imported from ``tree``."""
    paths = [str(tree), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    probe = [sys.executable, "-P", "-c", "import mlx_spec; print(mlx_spec.__file__)"]
    where = subprocess.run(probe, env=env, capture_output=True, text=True, check=True).stdout
    if not Path(where.strip()).is_relative_to(tree):
        raise SystemExit(f"before.py: mlx_spec came from {where.strip()}, not from {tree}")
    script = tree / "benchmarks" / "generation.py"
    proc = subprocess.run(
        [sys.executable, "-P", str(script), *arguments], env=env, capture_output=True, text=True
    )
    if proc.returncode:
        raise SystemExit(f"before.py: {script} failed:\n{proc.stderr[-2000:]}")
    return proc.stdout


def rows(output: str, match: str) -> dict[tuple[str, str, str], str]:
    """``(workload, temp, method) -> "x plain (x best fixed N), tok/round"`` for the rows of the
    generation tables in ``output`` whose method contains ``match``."""
    header: list[str] = []
    found = {}
    for line in output.splitlines():
        if not line.startswith("| "):
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if cells[0] == "workload":
            header = cells
        elif len(cells) == len(header) and match in cells[header.index("method")]:
            row = dict(zip(header, cells, strict=True))
            key = (row["workload"], row["temp"], row["method"])
            found[key] = f"{row['x plain']} ({row['x best fixed N']}), {row['tok/round']}"
    return found


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--commit", required=True, help="the earlier commit, or a directory holding its tree"
    )
    parser.add_argument("--rounds", type=int, default=2, help="runs of each, alternately")
    parser.add_argument("--rows", default="adaptive", help="the methods to compare (a substring)")
    args = parser.parse_args(argv[:split])
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    arguments = argv[split + 1 :]
    runs: dict[str, dict[tuple[str, str, str], str]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        before = export(args.commit, Path(scratch))
        for i in range(1, args.rounds + 1):
            for name, tree in ((f"before, run {i}", before), (f"now, run {i}", ROOT)):
                print(f"# {name} of {args.rounds}", file=sys.stderr, flush=True)
                runs[name] = rows(run(tree, arguments), args.rows)
    names = [name for name in runs if name.startswith("before")]
    names += [name for name in runs if name.startswith("now")]
    keys = list(dict.fromkeys(key for found in runs.values() for key in found))
    print(f"# generation.py {' '.join(arguments)}: before = {args.commit}, now = this checkout")
    print("# each cell: x plain (x best fixed N), tokens a round, measured within its run")
    print(f"| workload | temp | method | {' | '.join(names)} |")
    print("|---|---|---|" + "---|" * len(names))
    for key in keys:
        cells = [runs[name].get(key, "-") for name in names]
        print(f"| {' | '.join(key)} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
