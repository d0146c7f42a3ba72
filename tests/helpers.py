"""What the generation tests share: the prompt, a run of the loop, memory readings along one, a
drafter that proposes nothing, a minimal tokenizer, and a check of the benchmark's table."""

from __future__ import annotations

import re
import statistics

import mlx.core as mx

from mlx_spec.drafters import Draft, Drafter
from mlx_spec.generation import SpeculativeStats, speculative_generate_step

PROMPT = [1, 2, 3, 4, 5]


def run(prompt, model, draft, **kwargs) -> tuple[list[int], list[bool], SpeculativeStats]:
    """The tokens, ``from_draft`` flags and counts of one speculative generation."""
    stats = SpeculativeStats()
    tokens, flags = [], []
    for token, _, from_draft in speculative_generate_step(
        mx.array(prompt), model, draft, stats=stats, **kwargs
    ):
        tokens.append(token)
        flags.append(from_draft)
    return tokens, flags, stats


def memory_beyond_caches(steps, cache: list, every: int) -> list[int]:
    """Runs the generation ``steps``; every ``every`` tokens, the active memory beyond
    ``cache``'s own bytes (caches grow by design), after the kernels in flight have finished (and
    released their buffers: on a GPU they may still be running)."""
    samples = []
    for i, _ in enumerate(steps):
        if i % every == every - 1:
            mx.eval([c.state for c in cache])
            mx.synchronize()
            samples.append(mx.get_active_memory() - sum(c.nbytes for c in cache))
    return samples


class Silent(Drafter):
    """A free drafter that never proposes anything (a lookup that never matches): with adaptive
    lengths every token comes from a plain step of the loop's stretches."""

    free = True

    def propose(self, text, n, keys) -> Draft:
        return Draft(mx.array([], dtype=mx.uint32))


class ByteTokenizer:
    """The least a tokenizer needs for mlx-lm's ``TokenizerWrapper``: token ``i`` is a letter."""

    eos_token_id = 0
    bos_token = None
    chat_template = None

    def get_vocab(self) -> dict[str, int]:
        return {}

    def apply_chat_template(self, *args, **kwargs):
        raise NotImplementedError

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [1 + ord(c) % 200 for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids if i != 0)


def markdown_table(text: str, first_column: str) -> list[dict[str, str]]:
    """The rows of the Markdown table in ``text`` whose header begins ``| first_column |``, as
    dicts from the header's names to the cells' text."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_column} |"))

    def cells(line: str) -> list[str]:
        return [c.strip() for c in line.strip().strip("|").split("|")]

    header = cells(lines[start])
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(header, cells(line), strict=True)))
    return rows


def assert_ratio(printed: str, a: float, b: float) -> None:
    """``printed`` (``"1.23x"``) is ``a / b``, where ``a`` and ``b`` were printed to one decimal:
    up to the rounding of all three."""
    slack = 0.005 + (a / b) * (0.05 / a + 0.05 / b) + 1e-9
    assert abs(float(printed.rstrip("x")) - a / b) <= slack, (printed, a, b)


def assert_kept_at(line: dict[str, str], row: dict) -> None:
    """A table line's ``kept at 1/2/3/4`` is, in whole percent, how often the row's first draft
    positions were kept of the rounds that drafted there, whose counts add up to the row's."""
    assert sum(row["drafted_at"]) == row["drafted"] and sum(row["accepted_at"]) == row["accepted"]
    cell = line["kept at 1/2/3/4"]
    if not row["drafted"]:
        assert cell == "-"
        return
    shown = [int(v) for v in cell.removesuffix("%").split("/")]
    assert len(shown) == min(4, len(row["drafted_at"])), cell
    for percent, kept, drafted in zip(shown, row["accepted_at"], row["drafted_at"], strict=False):
        assert abs(percent - 100 * kept / drafted) <= 0.5 + 1e-9, (cell, row)


def assert_generation_table(text: str, rows: list[dict]) -> list[dict[str, str]]:
    """The table that ``mlx_spec.bench.table`` printed in ``text`` has a line per workload,
    temperature and method of ``rows`` (the raw rows of ``mlx_spec.bench.measure``), their
    steady-state tokens per round, and ratios that divide the printed tokens/s as the columns
    say: by plain decoding's, by mlx-lm's at the same N, by the fastest fixed N of the drafter."""
    table = markdown_table(text, "workload")
    steady = [r for r in rows if r["phase"] == "steady"]
    assert len(table) == len(steady)
    for line, row in zip(table, steady, strict=True):
        assert (line["workload"], line["method"]) == (row["workload"], row["name"])
        assert float(line["temp"]) == row["temp"]
        assert line["tok/round"] == f"{row['generated'] / row['rounds']:.2f}"
        assert int(line["replayed"]) == row["replayed"]
        assert_kept_at(line, row)
    for line in table:
        group = {
            m["method"]: float(m["tok/s"])
            for m in table
            if (m["workload"], m["temp"]) == (line["workload"], line["temp"])
        }
        speed = float(line["tok/s"])
        assert_ratio(line["x plain"], speed, group["plain"])
        drafter, _, length = line["method"].rpartition(" ")  # "draft residual", "N=2"
        if drafter == "draft" and f"mlx-lm {length}" in group:
            assert_ratio(line["x mlx-lm"], speed, group[f"mlx-lm {length}"])
        else:
            assert line["x mlx-lm"] == "-"
        if length == "adaptive":
            fixed = [v for k, v in group.items() if k.startswith(f"{drafter} N=")]
            assert_ratio(line["x best fixed N"], speed, max(fixed))
        else:
            assert line["x best fixed N"] == "-"
    return table


def spread_cell(cell: str) -> tuple[float, float, float]:
    """A cell that ``mlx_spec.bench.table`` printed for several passes, ``"12.3 (11.9-12.8)"``
    or ``"1.42x (1.31x-1.50x)"``: the median, min and max."""
    found = re.fullmatch(r"([\d.]+)(x?) \(([\d.]+)\2-([\d.]+)\2\)", cell)
    assert found, cell
    median, _, low, high = found.groups()
    return float(median), float(low), float(high)


def assert_spread_cells(table: list[dict[str, str]]) -> None:
    """In a table of several passes (:func:`markdown_table`), each median lies in its range, and
    each x plain range in what the printed tok/s ranges allow: a pass's ratio is its tok/s over
    plain decoding's in the same pass, at least the least tok/s over plain's most and at most the
    most over plain's least (up to the rounding of what was printed)."""
    for line in table:
        plain = next(
            m
            for m in table
            if (m["workload"], m["temp"], m["method"]) == (line["workload"], line["temp"], "plain")
        )
        cells = (line["tok/s"], plain["tok/s"], line["x plain"])
        speed, plain_speed, x = (spread_cell(c) for c in cells)
        for median, low, high in (speed, x):
            assert low <= median <= high, line
        slack = 0.005 + 0.05 / plain_speed[1] * (speed[2] / plain_speed[1] + 1)
        assert x[1] >= speed[1] / plain_speed[2] - slack, line
        assert x[2] <= speed[2] / plain_speed[1] + slack, line


def assert_spread_table(text: str, rows: list[dict]) -> list[dict[str, str]]:
    """The table that ``mlx_spec.bench.table`` printed in ``text`` from ``rows`` measured over
    several passes (``mlx_spec.bench.measure`` with ``repeats``): a line per steady row, whose
    tok/s is the median (min-max) of the row's passes, x plain the median (min-max) of its
    tok/s over plain decoding's pass by pass, and x mlx-lm and x best fixed N the ratios of the
    printed medians; each row's total tok/s lies within its passes' range."""
    table = markdown_table(text, "workload")
    steady = [r for r in rows if r["phase"] == "steady"]
    assert len(table) == len(steady)

    def shown(values: list[float], form: str, unit: str = "") -> str:
        median, low, high = statistics.median(values), min(values), max(values)
        return f"{median:{form}}{unit} ({low:{form}}{unit}-{high:{form}}{unit})"

    for line, row in zip(table, steady, strict=True):
        assert (line["workload"], line["method"]) == (row["workload"], row["name"])
        assert float(line["temp"]) == row["temp"]
        assert line["tok/round"] == f"{row['generated'] / row['rounds']:.2f}"
        assert int(line["replayed"]) == row["replayed"]
        assert_kept_at(line, row)
        passes = row["tokens_per_second_by_repeat"]
        assert len(passes) == row["repeats"] > 1
        assert min(passes) * (1 - 1e-9) <= row["tokens_per_second"] <= max(passes) * (1 + 1e-9)
        assert line["tok/s"] == shown(passes, ".1f")
        (plain,) = (
            r
            for r in steady
            if (r["workload"], r["temp"], r["drafter"]) == (row["workload"], row["temp"], "plain")
        )
        ratios = [a / b for a, b in zip(passes, plain["tokens_per_second_by_repeat"], strict=True)]
        assert line["x plain"] == shown(ratios, ".2f", "x")
    for line in table:
        group = {
            m["method"]: spread_cell(m["tok/s"])[0]
            for m in table
            if (m["workload"], m["temp"]) == (line["workload"], line["temp"])
        }
        speed = group[line["method"]]
        drafter, _, length = line["method"].rpartition(" ")  # "draft residual", "N=2"
        if drafter == "draft" and f"mlx-lm {length}" in group:
            assert_ratio(line["x mlx-lm"], speed, group[f"mlx-lm {length}"])
        else:
            assert line["x mlx-lm"] == "-"
        fixed = [v for k, v in group.items() if k.startswith(f"{drafter} N=")]
        if length == "adaptive" and fixed:
            assert_ratio(line["x best fixed N"], speed, max(fixed))
        else:
            assert line["x best fixed N"] == "-"
    return table


def bench_rows(speeds: dict[str, list[float]], drafted: int = 4, **fields) -> list[dict]:
    """Rows as ``mlx_spec.bench.measure`` writes them, of methods named as it names them
    (``"plain"``, ``"lookup adaptive"``, ``"draft N=2"``) with these tok/s over their passes, on
    one workload at one temperature (``fields`` overrides, such as ``workload``); the first
    runs are the first pass's."""
    rows = []
    for name, passes in speeds.items():
        drafter, _, length = name.partition(" ")
        for phase, kept in (("first", passes[:1]), ("steady", passes)):
            generated = 10 * len(kept)
            n = 0 if drafter == "plain" else 8 if length == "adaptive" else int(length[2:])
            row = {"workload": "open", "temp": 0.0, "name": name, "drafter": drafter, "n": n}
            row |= {"adaptive": length == "adaptive", "model": "", "phase": phase}
            rounds = generated if drafter == "plain" else generated - 2 * len(kept)
            row |= {
                "rounds": rounds,
                "drafted": 0 if drafter == "plain" else drafted * len(kept),
                "accepted": 0 if drafter == "plain" or not drafted else 2 * len(kept),
                "generated": generated,
                "replayed": 0,
                "seconds": sum(10 / s for s in kept),
            }
            row |= {
                "tokens_per_second": generated / row["seconds"],
                "tokens_per_round": generated / rounds,
                "acceptance_rate": row["accepted"] / row["drafted"] if row["drafted"] else 0.0,
                "repeats": len(kept),
                "tokens_per_second_by_repeat": list(kept),
            }
            rows.append(row | fields)
    return rows
