"""What the generation tests share: the prompt, a run of the loop, a minimal tokenizer, and a
check of the benchmark's table."""

from __future__ import annotations

import mlx.core as mx

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
    for line in table:
        group = {
            m["method"]: float(m["tok/s"])
            for m in table
            if (m["workload"], m["temp"]) == (line["workload"], line["temp"])
        }
        speed = float(line["tok/s"])
        assert_ratio(line["x plain"], speed, group["plain"])
        drafter, _, length = line["method"].partition(" ")
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
