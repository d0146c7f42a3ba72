"""Writes ``docs/performance.md`` from the benchmark results kept in ``docs/results/``.

Run ``python scripts/performance.py`` to rewrite the page, or ``python scripts/performance.py
--check`` to exit with status 1 when the page differs from what would be written
(``tests/test_docs.py`` runs it).

The page shows the current state: the newest result of each benchmark, per machine and model
pair, under the command that made it. Older results stay in git's history of their files.

``docs/results/index.json`` lists the machines in page order. Each has a ``platform`` (its heading),
an optional ``note`` and its ``results``; each result has a ``title`` (its heading, unique on the
page), a ``file``, the ``command`` that made it, an optional ``note`` and, for
``benchmarks/distributed.py``'s rows, ``"kind": "distributed"`` (``benchmarks/batched.py``'s:
``"kind": "batched"``; ``benchmarks/fused_generation.py``'s: ``"kind": "fused"``;
``benchmarks/server.py``'s: ``"kind": "server"``). A note says what
its table shows and why; the page quotes no dates, commits or machine paths.

Result files are named by machine, benchmark and pair (``gpu/generation-demo.json``), never by
commit. Each records the commit it measured (its full hash) and the date of the run:

- a benchmark's ``--json`` output: a top-level ``"commit"`` field; the date is the
  ``machine.date`` the benchmark wrote;
- a Markdown table a benchmark printed: a first line ``<!-- commit: HASH; date: YYYY-MM-DD -->``,
  and no date in the table's caption.

To renew a result: run its command, copy its output over the file, record the commit and the
date as above, update the note if what the table shows has changed, and run this script.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
OUT = ROOT / "docs" / "performance.md"
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import batched  # noqa: E402
import fused_generation  # noqa: E402
import server  # noqa: E402
from distributed import speedups  # noqa: E402
from generation import replay_table  # noqa: E402

from mlx_spec import bench  # noqa: E402

# The line that opens a Markdown result: ``<!-- commit: HASH; date: ... -->``.
RECORD = re.compile(r"\A<!-- commit: (?P<commit>\S+); date: (?P<date>[^;]+?) -->\n")

HEADER = """\
# Performance

The newest measurement of each benchmark, per machine and model pair, each under the command that
made it. `python scripts/performance.py` writes this page from [results/](results/), where each
result records the commit it measured and the date of the run; older runs are in git's history
of those files.

How to read the tables:

- Every ratio compares methods measured in one run, interleaved prompt by prompt
  (`mlx_spec.bench.measure`), so that load on a shared machine hits them alike. Compare ratios
  across tables, not tokens/s: the machines are shared and their speed varies from run to run.
- Each method runs twice in a row on each prompt. The tables show the second run (the steady
  state); "first-use time / steady" is the first run's time over the second's.
- `x plain`: tokens/s over plain decoding's (mlx-lm's `generate_step`). `x mlx-lm`: a draft model
  at fixed `N` over mlx-lm's own speculative loop at that `N`. `x best fixed N`: adaptive over the
  fastest fixed `N` of the same drafter in the same run.
- `lookup` is prompt lookup (`drafter="prompt-lookup"`), `draft` the pair's draft model; `adaptive`
  chooses each round's `N`, up to 8 ([design.md](design.md#the-draft-length)).
"""


def slug(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading.

    Args:
        heading (str): the heading's text, without its ``#`` marks.

    Returns:
        str: lower case, punctuation dropped, spaces as hyphens.
    """
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def recorded(path: Path) -> dict[str, str]:
    """The commit a result measured and the date of its run, read from the result itself.

    Args:
        path (Path): a ``.json`` or ``.md`` result in ``docs/results/``.

    Returns:
        dict[str, str]: ``commit`` (a hash) and ``date``.

    Raises:
        ValueError: the file records no commit, or not as a hash; the message names the file.
    """
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        data = json.loads(text)
        found = {"commit": data.get("commit", ""), "date": data["machine"]["date"]}
    else:
        match = RECORD.match(text)
        found = match.groupdict() if match else {"commit": "", "date": ""}
    if not re.fullmatch(r"[0-9a-f]{7,40}", found["commit"]):
        raise ValueError(f"{path.relative_to(ROOT)} records no commit: see scripts/performance.py")
    return found


def _machine(m: dict[str, Any]) -> str:
    ranks = f", {m['ranks']} ranks" if m.get("ranks", 1) > 1 else ""
    return (
        f"{m['system']}, {m['cpu_count']} cores, MLX {m['mlx']} ({m['device']}), "
        f"mlx-lm {m['mlx_lm']}{ranks}"
    )


def _settings(data: dict[str, Any]) -> str:
    s = data["settings"]
    pair = data.get("pair") or f"pair {s.get('pair')}"
    tokens = s.get("max_tokens", s.get("tokens"))
    return f"{pair}; {s['prompts']} prompt(s) per workload x {tokens} tokens"


def _repeats(count: int) -> str:
    return f", each prompt run {count} times, interleaved" if count > 1 else ""


def _generation(data: dict[str, Any]) -> str:
    parts = [bench.table(bench.summarize(data["rows"]))]
    if data.get("replay"):
        parts.append(
            "Taking recurrent caches back, at temperature 0, with a drafter right with "
            f"probability {data['settings']['forced_acceptance']} at fixed positions of the text "
            "(the hybrids and their attention-only twin keep the same drafts)"
            + _repeats(data["settings"].get("repeats", 1))
            + ":\n\n"
            + bench.table(bench.summarize(data["replay"]))
            + "\n\nEach hybrid's speedup over its own plain decoding beside the twin's:\n\n"
            + replay_table(bench.summarize(data["replay"]))
        )
    return "\n\n".join(parts)


def _distributed(data: dict[str, Any]) -> str:
    lines = bench.summarize(data["rows"])
    layouts = sorted({s["model"] for s in lines}, reverse=True)
    parts = [
        f"{layout}:\n\n" + bench.table([s for s in lines if s["model"] == layout])
        for layout in layouts
    ]
    if len(layouts) == 2:
        parts.append("Speedups over plain decoding, split against whole:\n\n" + speedups(lines))
    return "\n\n".join(parts)


def _batched(data: dict[str, Any]) -> str:
    s = data["settings"]
    return (
        f"Temperature {s['temp']}, N = {s['draft_tokens']}, median of {s['passes']} passes:\n\n"
        + batched.table(batched.summarize(data["rows"]))
    )


def _fused(data: dict[str, Any]) -> str:
    s = data["settings"]
    return (
        f"Acceptance {s.get('acceptance', 'coupled')}, {s['passes']} passes:\n\n"
        + fused_generation.table(data["rows"])
    )


def _server(data: dict[str, Any]) -> str:
    s = data["settings"]
    return (
        f"Greedy, {s['requests']} requests a client x {s['tokens']} tokens, "
        f"`--num-draft-tokens {s['draft_tokens']}`, median of {s['passes']} passes:\n\n"
        + server.table(server.summarize(data["rows"]))
    )


#: The table of each result ``kind`` (the generation table where it has none).
KINDS = {"distributed": _distributed, "batched": _batched, "fused": _fused, "server": _server}


def section(entry: dict[str, Any]) -> str:
    """One result: its title, command, machine, note and table.

    Args:
        entry (dict): one of ``index.json``'s results.

    Returns:
        str: Markdown, ending in a newline.
    """
    path = RESULTS / entry["file"]
    recorded(path)  # the page names the file, which names the commit
    facts = f"Measured at the commit recorded in [{entry['file']}](results/{entry['file']})."
    if path.suffix == ".json":
        data = json.loads(path.read_text(encoding="utf-8"))
        facts = f"{_machine(data['machine'])}; {_settings(data)}. {facts}"
        body = KINDS.get(entry.get("kind"), _generation)(data)
    else:
        # A printed table's title line ("# ...") is a caption here, not a heading.
        text = RECORD.sub("", path.read_text(encoding="utf-8")).strip()
        body = re.sub(r"^# (.*)\n+", r"*\1*\n\n", text, flags=re.M)
    out = [f"### {entry['title']}", "", f"`{entry['command']}`", "", facts, ""]
    if entry.get("note"):
        out += [entry["note"], ""]
    return "\n".join([*out, body, ""])


def contents(index: list[dict[str, Any]]) -> str:
    """The page's contents: each machine, and under it each table's title, as links.

    Args:
        index (list): ``index.json``.

    Returns:
        str: a Markdown list.

    Raises:
        ValueError: two headings would share an anchor; the message names it.
    """
    lines, seen = ["Contents:", ""], set()
    for platform in index:
        titles = [platform["platform"], *(e["title"] for e in platform["results"])]
        for depth, title in enumerate(titles):
            anchor = slug(title)
            if anchor in seen:
                raise ValueError(f"index.json: two headings give the anchor #{anchor}")
            seen.add(anchor)
            lines.append(f"{'  ' if depth else ''}- [{title}](#{anchor})")
    return "\n".join(lines) + "\n"


def render() -> str:
    """The page, from ``docs/results/``."""
    index = json.loads((RESULTS / "index.json").read_text(encoding="utf-8"))
    parts = [HEADER, contents(index)]
    for platform in index:
        parts.append(f"## {platform['platform']}\n")
        if platform.get("note"):
            parts.append(platform["note"] + "\n")
        parts += [section(entry) for entry in platform["results"]]
    return "\n".join(parts).rstrip() + "\n"


def main() -> int:
    """Rewrites the page, or with ``--check`` returns 1 where it is out of date."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is out of date")
    args = parser.parse_args()
    page = render()
    if args.check:
        current = OUT.read_text(encoding="utf-8") if OUT.exists() else ""
        if current != page:
            print(f"{OUT} is out of date: run python scripts/performance.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(page, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
