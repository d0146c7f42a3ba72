"""``benchmarks/generation.py``, ``proposal_cost.py``, ``plain_steps.py`` and
``chunked_attention.py`` print what they measured: the tables agree with the raw rows and their
ratios divide the printed numbers as the columns say.
The forced drafter of the replay comparison gives two targets the same acceptance. No timing is
asserted."""

from __future__ import annotations

import functools
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from helpers import assert_generation_table, assert_ratio, markdown_table
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler as lm_make_sampler
from tiny_models import tiny_llama

from mlx_spec import _demo, bench
from mlx_spec.generation import SpeculativeStats, speculative_generate_step

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def script(name: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """Runs ``python benchmarks/<name>.py *args``."""
    return subprocess.run(
        [sys.executable, str(BENCHMARKS / f"{name}.py"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize(
    "workloads",
    [
        pytest.param(["open"], marks=pytest.mark.quick_only),
        pytest.param(["input-grounded", "open"], marks=pytest.mark.slow),
    ],
    ids=["open", "both"],
)
def test_generation_quick_on_the_demo_pair(tmp_path, capsys, monkeypatch, workloads):
    # --quick at 6 tokens a generation instead of 16 (the MTP head adds two methods): the
    # table's checks are the same. The quick
    # run takes the open workload alone, whose prompts are a dozen tokens (an input-grounded one
    # runs to 184, and its prefills take most of the time on a CPU); --full both, with the
    # demo's input-grounded prompt a third that length, as test_cli.py's bench run. In-process:
    # plain_steps below starts the one subprocess a benchmark needs.
    monkeypatch.setattr(bench, "GROUNDED", _demo.GROUNDED[1:2])
    out = tmp_path / "rows.json"
    argv = ["--pair", "demo", "--quick", "--tokens", "6", "--workload", *workloads]
    benchmark("generation").main([*argv, "--json", str(out)])
    printed = capsys.readouterr().out
    results = json.loads(out.read_text())
    rows = results["rows"]
    names = ["plain", "mlx-lm N=2", "draft N=2", "draft adaptive", "lookup N=2", "lookup adaptive"]
    names += ["mtp N=2", "mtp adaptive"]  # the shipped target has an MTP head
    assert sorted({r["name"] for r in rows}) == sorted(names)
    assert sorted({r["workload"] for r in rows}) == sorted(workloads)
    assert len(rows) == len(workloads) * 2 * len(names) * 2  # workloads, temperatures, phases
    assert all(r["generated"] == 6 for r in rows)
    assert_generation_table(printed, rows)
    assert results["replay"] == []


@pytest.mark.slow
def test_generation_variants_set_the_residual_rule_and_kernels_off_beside_the_defaults(
    tmp_path, capsys
):
    out = tmp_path / "rows.json"
    argv = ["--pair", "demo", "--quick", "--tokens", "6", "--workload", "open", "--temps", "0.8"]
    benchmark("generation").main([*argv, "--variants", "2", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    names = {r["name"] for r in rows}
    variants = {"draft residual N=2", "draft residual adaptive", "draft residual, no kernels N=2"}
    variants |= {"draft, no kernels N=2", "lookup, no kernels N=2", "mtp, no kernels N=2"}
    assert variants <= names
    # Each kind against its own: the residual adaptive row's best fixed N is the residual N=2.
    table = assert_generation_table(capsys.readouterr().out, rows)
    assert {line["method"] for line in table} == names


@pytest.mark.slow
def test_generation_quick_on_the_hybrid_pair_compares_the_replay(tmp_path):
    out = tmp_path / "rows.json"
    args = ("--pair", "hybrid", "--quick", "--workload", "open", "--temps", "0", "--repeats", "1")
    args += ("--json", str(out))
    proc = script("generation", *args)
    assert proc.returncode == 0, proc.stderr
    results = json.loads(out.read_text())
    assert not any(r["drafter"] == "mlx-lm" for r in results["rows"])  # it refuses hybrids
    assert_generation_table(proc.stdout, results["rows"])
    lines = markdown_table(proc.stdout, "workload | hybrid")
    assert [line["hybrid"] for line in lines] == ["qwen3-next", "qwen3-next replayed", "lfm2"]
    for line in lines:
        assert_ratio(
            line["hybrid / twin"], float(line["x plain"][:-1]), float(line["twin x plain"][:-1])
        )
    forced = [r for r in results["replay"] if r["drafter"] == "forced"]
    assert {r["model"] for r in forced} == {"qwen3-next", "qwen3-next replayed", "lfm2", "twin"}
    # The gated delta-net hybrid keeps its states per position (unless told not to); the
    # short-convolution one replays what it kept; the twin trims.
    for r in forced:
        assert (r["replayed"] > 0) == (r["model"] in ("qwen3-next replayed", "lfm2")), r
        assert r["generated"] == 16  # the one prompt once


@pytest.mark.slow
def test_chunked_attention_compares_both_ways_on_the_demo_pair(capsys, monkeypatch):
    # A long run on a CPU (its prefills of the demo's prompts): --full, in-process, with the
    # demo's shortest input-grounded prompt alone (the chunks split a verification's queries,
    # whatever the prompt). The quick run keeps test_attention.py's checks of the chunks'
    # attention and of the tokens they give.
    monkeypatch.setattr(bench, "GROUNDED", _demo.GROUNDED[1:2])
    args = ["--pair", "demo", "--temps", "0", "--tokens", "8", "--repeats", "1"]
    benchmark("chunked_attention").main(args)
    printed = capsys.readouterr().out
    passes = markdown_table(printed, "forward over q tokens")
    assert [row["forward over q tokens"] for row in passes] == ["whole (ms)", "chunked (ms)"]
    assert all(float(row[f"q={q}"]) > 0 for row in passes for q in (1, 3, 4, 5, 9))
    lines = markdown_table(printed, "temp")
    assert [line["method"] for line in lines] == ["lookup N=8", "lookup adaptive", "draft N=4"]
    for line in lines:
        plain, whole, chunked = (
            float(line[f"{m} ms/token"]) for m in ("plain", "whole", "chunked")
        )
        assert_ratio(line["whole x plain"], plain, whole)
        assert_ratio(line["chunked x plain"], plain, chunked)
        assert_ratio(line["whole / chunked"], whole, chunked)
        # On this CPU both ways round alike on the demo pair: the same greedy tokens.
        assert line["same tokens"] == "yes"


@functools.cache
def benchmark(name: str):
    """``benchmarks/<name>.py`` as a module."""
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def forced_stats(model, wrong) -> SpeculativeStats:
    """Greedy speculation with ``N = 3`` and the forced drafter of ``model`` for ``wrong``."""
    prompt = mx.array([1, 2, 3, 4, 5])
    drafter = benchmark("generation").forced(model, [prompt], 44, wrong)(prompt)
    stats = SpeculativeStats()
    for _ in speculative_generate_step(
        prompt, model, num_draft_tokens=3, max_tokens=40, drafter=drafter, stats=stats
    ):
        pass
    return stats


def test_forced_drafter_gives_two_targets_the_same_acceptance():
    wrong = np.random.default_rng(0).random(44) >= 0.7
    first, second = (forced_stats(tiny_llama(seed), wrong) for seed in (0, 7))
    assert first == second
    assert 0 < first.accepted < first.drafted


def test_forced_drafters_with_other_wrong_positions_part():
    # The control: the same targets, wrong at other positions, keep other drafts.
    rng = np.random.default_rng(0)
    first = forced_stats(tiny_llama(0), rng.random(44) >= 0.7)
    second = forced_stats(tiny_llama(7), rng.random(44) >= 0.7)
    assert first != second


@pytest.mark.slow
def test_proposal_cost_table():
    # A long run on a CPU: the round it compares with follows a prefill of 1,000 tokens of the
    # demo target. --full.
    proc = script("proposal_cost", "--contexts", "200", "3000", "--drafts", "2", "--rounds", "5")
    assert proc.returncode == 0, proc.stderr
    table = markdown_table(proc.stdout, "context")
    assert [(r["context"], r["N"]) for r in table] == [("200", "2"), ("3000", "2")]
    for row in table:
        proposal, round_time = (
            float(row["propose + update (us)"]),
            float(row["round of the target (ms)"]),
        )
        share = float(row["proposal / round"].rstrip("%"))
        assert abs(share - 100 * proposal * 1e-6 / (round_time * 1e-3)) <= 0.01


@pytest.mark.slow
def test_stream_table():
    proc = script("stream", "--tokens", "4", "--prompts", "1", "--repeats", "1")
    assert proc.returncode == 0, proc.stderr
    table = markdown_table(proc.stdout, "workload")
    assert [r["workload"] for r in table] == ["input-grounded", "open"]
    methods = ["plain", "mlx-lm draft", "draft", "draft adaptive", "lookup adaptive"]
    for row in table:
        plain = float(row["plain"])
        for method in methods:
            rate, ratio = float(row[method]), float(row[f"x plain {method}"].rstrip("x"))
            # Rates printed to 0.05 tokens/s, ratios to 0.005.
            slack = 0.005 + ratio * (0.05 / rate + 0.05 / plain)
            assert rate > 0 and abs(ratio - rate / plain) <= slack


@pytest.mark.parametrize(
    ("args", "message"),
    [(["--prompts", "5"], "argument --prompts: must be in [1, 4], got '5'"),
     (["--num-draft-tokens", "0"], "argument --num-draft-tokens: must be in [1, 64], got '0'"),
     (["--tokens", "0"], "argument --tokens: must be >= 1, got '0'")],
)  # fmt: skip
def test_stream_refuses_bad_arguments_before_loading(args, message):
    proc = script("stream", *args, timeout=60)
    assert proc.returncode == 2 and proc.stderr.strip().endswith(message), proc.stderr
    assert not proc.stdout


def test_plain_steps_table():
    proc = script(
        "plain_steps", "--pair", "host", "--temps", "0", "0.8", "--tokens", "16", "--repeats", "1",
        "--ablate",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = markdown_table(proc.stdout, "pair")
    assert [(row["pair"], row["temp"]) for row in rows] == [("host", "0.0"), ("host", "0.8")]
    for row in rows:
        plain = float(row["plain"])
        methods = ("stretch", "lookup", "lookup, one policy", "stretch, policy asked", "loop")
        for method in (*methods, "+draw", "+cache"):
            # Milliseconds printed to 3 decimals, the ratio to 2.
            ms = float(row[method])
            slack = 0.005 + (plain / ms) * (0.0005 / plain + 0.0005 / ms)
            assert abs(float(row[f"plain / {method}"].rstrip("x")) - plain / ms) <= slack


def test_key_chain_table(capsys):
    benchmark("key_chain").main(["--positions", "40", "--repeats", "1"])
    out = capsys.readouterr().out
    assert "40 positions, median of 1" in out
    (row,) = markdown_table(out, "host")
    host, device = float(row["host"]), float(row["device"])
    assert host > 0 and device > 0 and float(row["split"]) > 0 and float(row["hash"]) > 0
    # Microseconds printed to 1 decimal, the ratio to 2.
    slack = 0.005 + (device / host) * (0.05 / host + 0.05 / device)
    assert abs(float(row["device / host"].rstrip("x")) - device / host) <= slack


def test_key_chain_refuses_a_chain_that_is_not_mlx_lms(monkeypatch):
    # The script checks each way's keys against mlx-lm's sequence before timing any.
    module = benchmark("key_chain")
    monkeypatch.setitem(module.METHODS, "host", lambda start: lambda position: start[None])
    with pytest.raises(SystemExit, match="the host chain gave other keys"):
        module.main(["--positions", "4", "--repeats", "1"])


def test_plain_steps_of_a_batch(capsys):
    benchmark("plain_steps").main(
        ["--pair", "host", "--temps", "0.8", "--tokens", "6", "--repeats", "1", "--batch", "3"]
    )
    out = capsys.readouterr().out
    assert "batch 3, 6 tokens a sequence" in out
    (row,) = markdown_table(out, "pair")
    assert (row["pair"], row["temp"]) == ("host", "0.8")
    plain = float(row["plain"])
    for method in ("stretch", "lookup"):
        ms = float(row[method])
        assert ms > 0 and float(row[f"plain / {method}"].rstrip("x")) > 0
        # Milliseconds printed to 3 decimals, the ratio to 2.
        slack = 0.005 + (plain / ms) * (0.0005 / plain + 0.0005 / ms)
        assert abs(float(row[f"plain / {method}"].rstrip("x")) - plain / ms) <= slack
    with pytest.raises(SystemExit):
        benchmark("plain_steps").main(["--batch", "0"])


@pytest.mark.slow
def test_adaptive_lookup_keeps_up_with_fixed_lengths_under_modelled_gpu_costs() -> None:
    # The demo target copying its prompt (GROUNDED[1]) and writing freely (PROMPTS[0]), greedy,
    # every round and plain step charged the GPU's modelled cost (benchmarks/draft_length.py),
    # the adaptive policy told those costs: it must do about as well as the best fixed N on the
    # copy (within 10%), and must not cost more than a few percent against plain decoding where
    # lookup rarely helps.
    from mlx_spec.draft_length import Adaptive, Fixed

    model = benchmark("draft_length")
    pair = benchmark("generation").build_pair("demo", 2)
    costs = model.DEVICES["gpu"]
    calibration = costs.calibration(model_drafter=False)

    def rate(prompt, policy):
        return model.modelled_rate(pair.target, prompt, 0.0, policy, costs)[0]

    copy, open_prompt = pair.workloads["input-grounded"][1], pair.workloads["open"][0]
    best = max(rate(copy, Fixed(n)) for n in (1, 2, 4, 8))
    assert best > 1.5  # the copy is worth drafting: the comparison is not vacuous
    assert rate(copy, Adaptive(8, calibration)) >= 0.9 * best
    assert rate(open_prompt, Adaptive(8, calibration)) >= 0.95


def test_fused_generation_pairs_each_method_with_its_twin_and_judges_every_pass():
    # Lines as bench.summarize gives them: each method's tokens/s in every pass. The verdict is
    # "gain" only where every pass ran faster with the kernels, "loss" only where every one ran
    # slower, and a method is set beside its own twin (the same name with ", no kernels").
    def line(name, speeds, temp=0.0):
        return {
            "workload": "open",
            "temp": temp,
            "name": name,
            "tokens_per_round": 2.0,
            "tokens_per_second_by_repeat": speeds,
        }

    lines = [
        line("draft N=4", [110.0, 120.0, 105.0]),
        line("draft, no kernels N=4", [100.0, 100.0, 100.0]),
        line("lookup adaptive", [90.0, 95.0, 99.0]),
        line("lookup, no kernels adaptive", [100.0, 100.0, 100.0]),
        line("mtp N=4", [90.0, 120.0, 100.0]),
        line("mtp, no kernels N=4", [100.0, 100.0, 100.0]),
        line("draft N=4", [100.0, 100.0, 100.0], temp=0.8),
        line("draft, no kernels N=4", [50.0, 50.0, 50.0], temp=0.8),
    ]
    rows = {(r["temp"], r["method"]): r for r in benchmark("fused_generation").compare(lines)}
    assert set(rows) == {
        (0.0, "draft N=4"),
        (0.0, "lookup adaptive"),
        (0.0, "mtp N=4"),
        (0.8, "draft N=4"),
    }
    assert rows[0.0, "draft N=4"]["verdict"] == "gain"
    assert rows[0.0, "draft N=4"]["ratios"] == pytest.approx([1.1, 1.2, 1.05])
    assert rows[0.0, "lookup adaptive"]["verdict"] == "loss"
    assert rows[0.0, "mtp N=4"]["verdict"] == "noise"
    assert rows[0.8, "draft N=4"]["ratios"] == pytest.approx([2.0, 2.0, 2.0])


def test_mtp_cost_times_the_three_steps_on_the_demo_pair(capsys):
    rows = benchmark("mtp_cost").main(["--pair", "demo", "--repeats", "5", "--context", "16"])
    printed = markdown_table(capsys.readouterr().out, "pair")
    assert [r["pair"] for r in rows] == ["demo"] and rows[0]["head"] == "shipped"
    (row,) = printed
    for key, column in (("target", "target step (ms)"), ("mtp", "MTP step (ms)")):
        assert rows[0][key] > 0
        assert float(row[column]) == pytest.approx(rows[0][key] * 1e3, abs=0.0005)
    assert float(row["MTP / target"]) == pytest.approx(
        rows[0]["mtp"] / rows[0]["target"], abs=0.0005
    )
    # One decoder layer and the LM head against six layers and the same head.
    assert rows[0]["mtp"] < rows[0]["target"]


def test_batched_runs_every_method_and_the_serial_one_generates_as_many_tokens(capsys):
    results = benchmark("batched").main(
        ["--batches", "2", "--tokens", "6", "--prompts", "2", "--passes", "1", "--workload", "open"]
    )
    rows = {r["method"]: r for r in results["rows"]}
    assert list(rows) == list(benchmark("batched").METHODS)
    # Greedy, the same prompts: every method generates the same number of tokens per request.
    assert {r["tokens"] for r in rows.values()} == {rows["BatchGenerator"]["tokens"]}
    serial = rows["mlx-lm draft, serial"]
    # One request after the other: the second finishes after the first.
    assert serial["latencies"][1] > serial["latencies"][0]
    printed = markdown_table(capsys.readouterr().out, "workload")
    assert [r["method"] for r in printed] == list(rows)


def test_batched_summary_gives_the_median_and_the_first_pass_over_batch_generator() -> None:
    batched = benchmark("batched")
    # tokens/s in each pass: the first pass of the adaptive method is its slowest.
    speeds = {"BatchGenerator": (100, 100, 100), "lookup adaptive": (60, 110, 120)}
    rows = [
        {"workload": "open", "batch": 4, "method": method, "pass": p, "tokens": tokens,
         "seconds": 1.0, "latencies": [0.5, 1.0], "first_tokens": [0.1, 0.2]}
        for method, per_pass in speeds.items()
        for p, tokens in enumerate(per_pass)
    ]  # fmt: skip
    lines = {x["method"]: x for x in batched.summarize(rows)}
    assert lines["lookup adaptive"]["x_baseline"] == pytest.approx(1.10)
    assert lines["lookup adaptive"]["x_baseline_first"] == pytest.approx(0.60)
    printed = {r["method"]: r for r in markdown_table(batched.table(lines.values()), "workload")}
    assert printed["lookup adaptive"]["x BatchGenerator"] == "1.10x"
    assert printed["lookup adaptive"]["first pass x BatchGenerator"] == "0.60x"
    assert printed["BatchGenerator"]["first pass x BatchGenerator"] == "1.00x"


def server_row(server: str, clients: int, tokens: int, seconds: float, p: int = 0) -> dict:
    return {
        "workload": "open", "clients": clients, "server": server, "pass": p, "tokens": tokens,
        "seconds": seconds, "latencies": [seconds / 2, seconds],
    }  # fmt: skip


def test_server_benchmark_summary_takes_medians_and_ratios_to_each_mlx_lm_server() -> None:
    server = benchmark("server")
    rows = [
        server_row("mlx-lm, draft", 8, 100, 1.0, 0),
        server_row("mlx-lm, draft", 8, 100, 2.0, 1),
        server_row("mlx-lm, draft", 8, 100, 4.0, 2),  # median 50 tokens/s
        server_row("mlx-lm", 8, 200, 1.0),
        server_row("mlx-spec, draft", 8, 300, 1.0),
    ]
    lines = {x["server"]: x for x in server.summarize(rows)}
    assert lines["mlx-lm, draft"]["tokens_per_second"] == 50.0
    assert lines["mlx-spec, draft"]["x mlx-lm, draft"] == 6.0
    assert lines["mlx-spec, draft"]["x mlx-lm"] == 1.5
    assert lines["mlx-lm, draft"]["latency_max"] == 4.0
    table = markdown_table(server.table(list(lines.values())), "workload")
    assert [row["x mlx-lm"] for row in table] == ["0.25x", "1.00x", "1.50x"]


@pytest.mark.slow
def test_server_benchmark_drives_real_servers(tmp_path, capsys) -> None:
    out = tmp_path / "server.json"
    argv = ["--clients", "2", "--requests", "1", "--tokens", "4", "--passes", "1"]
    argv += ["--prompts", "1", "--workload", "open", "--servers", "mlx-lm", "mlx-spec, draft"]
    benchmark("server").main([*argv, "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert sorted(r["server"] for r in rows) == ["mlx-lm", "mlx-spec, draft"]
    assert all(0 < r["tokens"] <= 2 * 4 and len(r["latencies"]) == 2 for r in rows)
    assert "| open | 2 | mlx-spec, draft |" in capsys.readouterr().out


@pytest.mark.parametrize("temp", [0.0, 0.8])
def test_the_ablations_loops_decode_as_mlx_lm(temp):
    # Each loop of plain_steps --ablate must make mlx-lm's own tokens (seed 0, key 0), or what it
    # times is not the same decoding.
    target, prompt = tiny_llama(3), mx.array([1, 2, 3, 4, 5, 6], mx.uint32)
    mx.random.seed(0)
    sampler = lm_make_sampler(temp=temp)
    want = [t for t, _ in generate_step(prompt, target, max_tokens=24, sampler=sampler)]
    assert len(set(want)) > 3  # varied tokens, not one repeated
    loops = benchmark("plain_steps")._ablation(target, prompt, 24, temp)
    assert list(loops) == ["loop", "+draw", "+cache"]
    for name, run in loops.items():
        assert run() == want, name


def _in_git_checkout() -> bool:
    probe = ["git", "-C", str(BENCHMARKS), "rev-parse", "HEAD"]
    return subprocess.run(probe, capture_output=True, check=False).returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(not _in_git_checkout(), reason="before.py exports a commit with git")
def test_before_runs_a_commits_benchmark_and_this_ones_and_sets_them_side_by_side():
    proc = script(
        "before", "--commit", "HEAD", "--rounds", "1", "--",
        "--pair", "demo", "--quick", "--tokens", "6", "--workload", "open", "--temps", "0",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines() == ["# before, run 1 of 1", "# now, run 1 of 1"]
    rows = markdown_table(proc.stdout, "workload")
    assert list(rows[0]) == ["workload", "temp", "method", "before, run 1", "now, run 1"]
    assert [row["method"] for row in rows] == ["draft adaptive", "lookup adaptive", "mtp adaptive"]
    for row in rows:
        assert (row["workload"], row["temp"]) == ("open", "0.0")
        for cell in (row["before, run 1"], row["now, run 1"]):
            assert re.fullmatch(r"\d+\.\d\dx \(\d+\.\d\dx\), \d+\.\d\d", cell), cell


@pytest.mark.skipif(not _in_git_checkout(), reason="before.py exports a commit with git")
def test_before_names_a_commit_git_cannot_export():
    proc = script("before", "--commit", "no-such-commit", "--", "--quick")
    assert proc.returncode == 1
    assert "before.py: git archive no-such-commit failed" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_before_copies_a_commits_tree_from_a_directory_with_this_checkouts_demo(tmp_path):
    tree = tmp_path / "old"
    for name in ("mlx_spec", "benchmarks", "tests"):
        (tree / name).mkdir(parents=True)
        (tree / name / "marker.py").write_text(f"# {name} of the old tree\n")
    (tree / "mlx_spec" / "demo").mkdir()
    (tree / "mlx_spec" / "demo" / "stale.txt").write_text("the old demo\n")
    into = benchmark("before").export(str(tree), tmp_path / "into")
    for name in ("mlx_spec", "benchmarks", "tests"):
        assert (into / name / "marker.py").read_text() == f"# {name} of the old tree\n"
    demo = into / "mlx_spec" / "demo"
    assert not (demo / "stale.txt").exists()
    shipped = Path(_demo.__file__).parent / "demo"
    assert sorted(p.name for p in demo.iterdir()) == sorted(p.name for p in shipped.iterdir())
