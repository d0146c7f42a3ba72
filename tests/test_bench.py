"""``mlx_spec.bench`` measures what it labels: ``bench.mlx_lm`` runs mlx-lm's own speculative loop,
also while ``patch_mlx_lm()`` routes mlx-lm's through mlx-spec's.

A tiny random llama drafts for itself at temperature 1, where the two loops part: rejection
sampling keeps every draft token (``p == q``), mlx-lm's rule keeps one only when the target's own
sample equals it.

Then what the tables say of several passes: the median and range, and the noise and verdict
lines, each rule on either side of its threshold, from rows made up to the purpose.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import pytest
from helpers import bench_rows, markdown_table
from mlx_lm.models import llama

import mlx_spec
from mlx_spec import bench
from mlx_spec.generation import SpeculativeStats, speculative_generate_step

lm_generate = importlib.import_module("mlx_lm.generate")

MODEL = """
import mlx.core as mx
from mlx_lm.models import llama

args = llama.ModelArgs(
    model_type="llama", hidden_size=32, num_hidden_layers=2, intermediate_size=64,
    num_attention_heads=2, rms_norm_eps=1e-5, vocab_size=64,
)
mx.random.seed(0)
model = llama.Model(args)
mx.eval(model.parameters())
prompt = mx.array([1, 2, 3, 4])
"""


@pytest.fixture(scope="module")
def model() -> llama.Model:
    namespace: dict = {}
    exec(MODEL, namespace)
    return namespace["model"]


def test_mlx_lm_ignores_the_loop_installed_in_mlx_lm(model, monkeypatch):
    prompt = mx.array([1, 2, 3, 4])
    theirs = bench.mlx_lm(model, model, 4)
    before = theirs.generate(prompt, 1.0, 0, 40)
    calls = []

    def installed(*args, **kwargs):
        calls.append(args)
        return speculative_generate_step(*args, **kwargs)

    # What patch_mlx_lm() installs, counted.
    monkeypatch.setattr(lm_generate, "speculative_generate_step", installed)
    during = theirs.generate(prompt, 1.0, 0, 40)
    assert not calls
    assert during == before


def test_mlx_lm_keeps_mlx_lms_rule_when_imported_after_the_patch():
    # A fresh interpreter, patched before mlx_spec.bench is imported: names that bench took from
    # mlx-lm at import would then be mlx-spec's loop and sampler (rejection sampling).
    source = MODEL + textwrap.dedent("""
        import mlx_spec
        mlx_spec.patch_mlx_lm()
        from mlx_spec import bench
        for method in (bench.mlx_lm(model, model, 4), bench.mlx_spec(model, 4, draft=model)):
            stats = method.generate(prompt, 1.0, 0, 40)
            print(stats.drafted, stats.accepted)
    """)
    package = str(Path(mlx_spec.__file__).resolve().parents[1])
    run = subprocess.run(
        [sys.executable, "-c", source], capture_output=True, text=True, timeout=120, cwd=package
    )
    assert run.returncode == 0, run.stderr
    (theirs_drafted, theirs_accepted), (ours_drafted, ours_accepted) = (
        map(int, line.split()) for line in run.stdout.splitlines()
    )
    assert theirs_accepted < theirs_drafted
    assert ours_accepted == ours_drafted  # the control: mlx-spec keeps every draft token here


# -- passes, spreads and verdicts ---------------------------------------------------------------


def counting(name: str, calls: list) -> bench.Method:
    """A method that generates nothing, counting each call as ``(name, seed)``."""

    def generate(prompt, temp, seed, max_tokens):
        calls.append((name, seed))
        return SpeculativeStats(rounds=max_tokens, generated=max_tokens)

    return bench.Method(name, generate)


def test_measure_runs_the_first_pass_twice_in_a_row_and_later_passes_once():
    calls, steps = [], []
    methods = [counting(name, calls) for name in "abc"]
    prompts = [mx.array([1]), mx.array([2])]
    rows = bench.measure(
        methods, {"w": prompts}, [0.0], 4, repeats=3, on_run=lambda *step: steps.append(step)
    )
    # Each method meets prompt i with seed i: twice in the first pass, once in each later one.
    for name in "abc":
        assert sorted(seed for n, seed in calls if n == name) == [0] * 4 + [1] * 4
    # The order turns by one with each prompt, across the passes too.
    firsts = [name for (name, _), *_ in [calls[:2], calls[6:7], calls[9:10]]]
    assert firsts == ["a", "b", "c"]
    assert [s[:2] for s in steps] == [(k, 18) for k in range(1, 19)]
    assert steps[0][2] == "a, w, t=0.0, repeat 1/3" and steps[-1][2].endswith("repeat 3/3")
    for row in rows:
        passes = 1 if row["phase"] == "first" else 3
        assert row["repeats"] == len(row["tokens_per_second_by_repeat"]) == passes
        assert row["generated"] == 2 * 4 * passes


def test_measure_sums_counts_per_draft_position():
    def generate(prompt, temp, seed, max_tokens):
        return SpeculativeStats(rounds=1, generated=1, drafted_at=[1] * (seed + 1))

    rows = bench.measure([bench.Method("m", generate)], {"w": [mx.array([1])] * 3}, [0.0], 1)
    assert rows[0]["drafted_at"] == [3, 2, 1]


def test_mlx_lm_stats_counts_each_draft_position():
    # Rounds of N = 3 in mlx-lm's loop: 2 drafts kept, none, all 3, then the last token of 9,
    # a draft, alone in a round that could draft only 1.
    flags = [True, True, False, False, True, True, True, False, True]
    stats = bench.mlx_lm_stats(flags, 3, 9)
    assert (stats.rounds, stats.drafted, stats.accepted, stats.generated) == (4, 10, 6, 9)
    assert (stats.drafted_at, stats.accepted_at) == ([4, 3, 3], [3, 2, 1])


def test_the_table_shows_how_often_each_draft_position_was_kept():
    rows = bench_rows({"plain": [10.0], "lookup N=2": [12.0], "draft adaptive": [13.0]})
    # Kept at positions 1 and 2: 8 of 10, 5 of 10; adaptive: 17/20, 12/16, 3/10, 1/4, 0/2.
    counts = {
        "lookup N=2": ([10, 10], [8, 5]),
        "draft adaptive": ([20, 16, 10, 4, 2], [17, 12, 3, 1, 0]),
    }
    for row in rows:
        row["drafted_at"], row["accepted_at"] = counts.get(row["name"], ([], []))
    table = markdown_table(bench.table(bench.summarize(rows)), "workload")
    kept = {line["method"]: line["kept at 1/2/3/4"] for line in table}
    # The first four positions only: the fifth would widen every line.
    assert kept == {"plain": "-", "lookup N=2": "80/50%", "draft adaptive": "85/75/30/25%"}


def table_of(speeds: dict[str, list[float]], **fields) -> tuple[list[dict], str]:
    lines = bench.summarize(bench_rows(speeds, **fields))
    return lines, bench.table(lines)


def test_one_pass_prints_the_table_as_results_without_passes():
    rows = bench_rows({"plain": [10.0], "lookup adaptive": [14.0], "lookup N=2": [12.0]})
    older = [
        {k: v for k, v in r.items() if k not in ("repeats", "tokens_per_second_by_repeat")}
        for r in rows
    ]
    assert bench.table(bench.summarize(rows)) == bench.table(bench.summarize(older))
    line = bench.summarize(older)[1]
    assert line["x_plain"] == 14.0 / 10.0 and line["x_best_fixed"] == 14.0 / 12.0
    assert "(" not in bench.table(bench.summarize(rows))
    assert bench.report(bench.summarize(rows)) == ""  # no spread, no verdict


def test_several_passes_print_the_median_and_range():
    lines, table = table_of({"plain": [100.0, 104.0, 108.0], "lookup adaptive": [140, 150, 130]})
    plain, lookup = table.splitlines()[2:]
    assert "| 104.0 (100.0-108.0) |" in plain and "| 1.00x (1.00x-1.00x) |" in plain
    # Pass by pass: 140 / 100, 150 / 104, 130 / 108.
    assert "| 140.0 (130.0-150.0) |" in lookup and "| 1.40x (1.20x-1.44x) |" in lookup
    assert lines[1]["first_over_steady"] == (10 / 140) / (sum(10 / s for s in (140, 150, 130)) / 3)


QUIET = [100.0, 104.0, 108.0]  # a spread of 8 / 104 = 7.7% of the median


@pytest.mark.parametrize(
    ("lookup", "said"),
    [
        ([140.0, 150.0, 130.0], "open t=0.0 1.40x (1.20x-1.44x)"),
        ([80.0, 82.0, 85.0], "open t=0.0 slower at 0.79x (0.79x-0.80x)"),
        # Ratios 0.99, 1.01, 0.99: they hold 1 within the noise.
        ([99.0, 105.0, 107.0], None),
        # Ratios 0.80 to 1.15: they hold 1 over a range wider than twice the noise.
        ([80.0, 120.0, 100.0], "too noisy to tell"),
    ],
)
def test_a_drafters_verdict_follows_its_ratios_to_plain_decoding(lookup, said):
    lines, _ = table_of({"plain": QUIET, "lookup adaptive": lookup})
    assert bench.noise(lines) == (
        "Quiet enough for a verdict: plain decoding's tokens/s spread by at most 8% of its "
        "median over 3 repeats (a verdict needs at most 10%)."
    )
    expected = said or "no faster than plain decoding here"
    assert bench.verdicts(lines) == [f"prompt lookup, adaptive: {expected}"]


@pytest.mark.parametrize(
    ("plain", "noisy"), [([100.0, 105.0, 110.0], False), ([100.0, 105.0, 110.6], True)]
)
def test_too_noisy_when_plain_decoding_spreads_past_a_tenth_of_its_median(plain, noisy):
    # The same fast drafter either side of the line: 10 / 105 and 10.6 / 105 of the median.
    lines, _ = table_of({"plain": plain, "lookup adaptive": [150.0, 160.0, 170.0]})
    assert bench.noise(lines).startswith("Too noisy" if noisy else "Quiet enough")
    (verdict,) = bench.verdicts(lines)
    assert (verdict == "prompt lookup, adaptive: too noisy to tell") == noisy


def test_the_noise_line_counts_the_noisy_cases():
    rows = bench_rows({"plain": QUIET, "draft adaptive": [150.0, 160.0, 170.0]})
    rows += bench_rows(
        {"plain": [100.0, 130.0, 90.0], "draft adaptive": [150.0, 160.0, 170.0]},
        workload="input-grounded",
    )
    lines = bench.summarize(rows)
    assert bench.noise(lines) == (
        "Too noisy for a verdict in 1 of 2 cases: plain decoding's tokens/s spread by up to 40% "
        "of its median over 3 repeats (a verdict needs at most 10%); close other programs, or "
        "run again."
    )
    assert bench.verdicts(lines) == [
        "draft model, adaptive: open t=0.0 1.54x (1.50x-1.57x); input-grounded t=0.0 too noisy "
        "to tell"
    ]


def test_a_row_that_drafted_nothing_says_so():
    lines, _ = table_of({"plain": QUIET, "lookup adaptive": [140.0, 150.0, 130.0]}, drafted=0)
    assert bench.verdicts(lines) == [
        "prompt lookup, adaptive: open t=0.0 1.40x (1.20x-1.44x), drafted nothing"
    ]


def test_the_adaptive_method_speaks_for_its_drafter_and_fixed_ones_where_none_adapts():
    speeds = {"plain": QUIET, "mlx-lm N=2": QUIET, "draft N=2": QUIET, "draft N=4": QUIET}
    lines, _ = table_of(speeds | {"lookup N=2": QUIET, "lookup adaptive": QUIET})
    assert [v.split(":")[0] for v in bench.verdicts(lines)] == [
        "draft model, N=2",
        "draft model, N=4",
        "prompt lookup, adaptive",
    ]


def test_report_is_the_noise_line_then_a_verdict_per_drafter():
    lines, _ = table_of({"plain": QUIET, "lookup adaptive": [140.0, 150.0, 130.0]})
    assert bench.report(lines).splitlines() == [
        bench.noise(lines),
        "Against plain decoding (x plain: the median, and the range over the repeats):",
        "- prompt lookup, adaptive: open t=0.0 1.40x (1.20x-1.44x)",
    ]


def test_plot_draws_a_png_with_a_panel_per_case(tmp_path):
    pytest.importorskip("matplotlib")
    from PIL import Image

    rows = []
    for workload in ("input-grounded", "open"):
        for temp in (0.0, 0.8):
            speeds = {"plain": QUIET, "draft N=2": [120.0, 125.0, 118.0]}
            rows += bench_rows(
                speeds | {"lookup adaptive": [150.0, 140.0, 160.0]}, workload=workload, temp=temp
            )
    path = tmp_path / "plot.png"
    bench.plot(bench.summarize(rows), path, "a title")
    with Image.open(path) as image:
        width, height = image.size
    # Two columns (temperatures), two rows (workloads).
    assert width > height > 0.6 * width
