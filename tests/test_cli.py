"""The ``mlx-spec`` command, driven as a user drives it.

Each subcommand runs on the shipped demo pair (no download) and its output is checked for what
it claims: the counts agree with each other, greedy speculation prints the target's own greedy
text, a seed reproduces a run, the benchmark's JSON and table agree, the spread and the verdicts
follow from the runs. Each error is one line on stderr with exit status 2 and no traceback. No
timing is asserted.

Commands run in this process through ``mlx_spec.cli.main``, as the console script calls it, and
each once in a subprocess as ``python -m mlx_spec`` (a smoke test of the installed command);
what only a process shows (what ``--help`` imports, a closed pipe, Ctrl-C) runs in subprocesses.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import pytest
from helpers import (
    assert_ratio,
    assert_spread_cells,
    assert_spread_table,
    bench_rows,
    markdown_table,
    spread_cell,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx.utils import tree_flatten

import mlx_spec
from mlx_spec import cli

DEMO = Path(mlx_spec.__file__).resolve().parent / "demo"
TARGET, DRAFT = str(DEMO / "target"), str(DEMO / "draft")


def mlx_spec_cmd(*args: str, env: dict | None = None, timeout: float = 300):
    """Runs ``python -m mlx_spec *args`` in a subprocess; returns the completed process (text
    output)."""
    return subprocess.run(
        [sys.executable, "-m", "mlx_spec", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


@dataclass
class Ran:
    """What a command run in this process returned and printed, named as in
    ``subprocess.CompletedProcess``."""

    returncode: int
    stdout: str
    stderr: str


def mlx_spec_main(*args: str) -> Ran:
    """Runs ``mlx-spec *args`` in this process as the console script does, ``sys.exit(main())``:
    a usage error or ``--help`` ends in ``SystemExit``, whose code is the status. The environment
    is restored after it (the commands set MLX's attention switch)."""
    out, err = io.StringIO(), io.StringIO()
    environment = dict(os.environ)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                status = cli.main(list(args))
            except SystemExit as exit:
                status = 0 if exit.code is None else exit.code
    finally:
        os.environ.clear()
        os.environ.update(environment)
    return Ran(status, out.getvalue(), err.getvalue())


@contextlib.contextmanager
def offline(folder: Path):
    """The Hugging Face hub offline, its cache in ``folder``: a model name that mlx-lm resolves
    (``org/model``) is looked up there and not fetched. What ``HF_HUB_OFFLINE=1`` and
    ``HF_HOME`` give a new process; huggingface_hub read those when it was imported."""
    from huggingface_hub import constants

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(constants, "HF_HUB_OFFLINE", True)
        patch.setattr(constants, "HF_HUB_CACHE", str(folder / "hub"))
        yield


def assert_one_line_error(proc, *fragments: str) -> str:
    """Exit status 2, nothing on stdout, one line on stderr holding every fragment."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def generate(*extra: str, model: str = TARGET, draft: str = DRAFT, prompt: str = "def f(x):"):
    pair = ("--model", model, "--draft-model", draft)
    return mlx_spec_main("generate", *pair, "--prompt", prompt, *extra)


SPECULATION = re.compile(
    r"Speculation: (?P<drafter>draft model|prompt lookup), N (?P<length>fixed|adaptive, at most) "
    r"(?P<n>\d+), (?P<rounds>\d+) rounds, (?P<drafted>\d+) drafted, (?P<accepted>\d+) accepted "
    r"\(acceptance rate (?P<rate>[\d.]+)%\), (?P<per_round>[\d.]+) tokens per round"
)
# The line when no round drafted (a generation of one token, or prompt lookup finding nothing).
NOTHING_DRAFTED = re.compile(
    r"Speculation: (?:draft model|prompt lookup), N (?:fixed|adaptive, at most) \d+, "
    r"(?P<rounds>\d+) rounds, nothing drafted, (?P<per_round>[\d.]+) tokens per round; seed \d+"
)


def generated_text(stdout: str) -> str:
    """What ``generate`` streamed: stdout before its ``==========`` line, less the newline."""
    return stdout.split("\n==========\n")[0]


# -- --help ------------------------------------------------------------------------------------


def test_help_lists_the_subcommands():
    proc = mlx_spec_main("--help")
    assert proc.returncode == 0
    for command in ("demo", "generate", "bench"):
        assert command in proc.stdout


@pytest.mark.parametrize(
    ("command", "options"),
    [
        (
            "demo",
            [
                *("--max-tokens", "--num-draft-tokens", "--fixed", "--repeats", "--seed"),
                *("--color", "prompt lookup"),
            ],
        ),
        (
            "generate",
            [
                *("--model", "--draft-model", "--prompt", "--temp", "--top-p", "--top-k"),
                *("--min-p", "--num-draft-tokens", "--max-tokens", "--seed", "--mtp"),
                "--ignore-chat-template",
            ],
        ),
        ("bench", ["--out", "--quick", "results.json", "prompt lookup", "adaptive"]),
    ],
)
def test_help_of_each_subcommand_names_its_options(command, options):
    proc = mlx_spec_main(command, "--help")
    assert proc.returncode == 0
    assert proc.stdout.startswith(f"usage: mlx-spec {command}")
    text = " ".join(proc.stdout.split())  # argparse wraps lines
    for option in options:
        assert option in text, option


KV_BITS_AND_SIZE = ("--kv-bits", "4", "--max-kv-size", "64")


@pytest.mark.parametrize(
    "args",
    [
        ("--help",),
        ("demo", "--help"),
        ("generate", "--help"),
        ("bench", "--help"),
        ("demo", "-n", "0"),
        ("generate", "--model", "no-such-folder/", "--draft-model", DRAFT, "--prompt", "x"),
        ("--version",),
        ("generate", "--model", TARGET, "--prompt-lookup", "--prompt", ""),
        ("generate", "--model", TARGET, "--prompt-lookup", "--prompt", "x", *KV_BITS_AND_SIZE),
    ],
)
def test_help_and_early_errors_do_not_import_mlx_lm(args):
    """They answer at once: -X importtime lists every module imported, on stderr."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "mlx_spec", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode in (0, 2), proc.stderr
    for heavy in ("mlx_lm", "matplotlib", "transformers"):
        assert heavy not in proc.stderr, heavy


def test_version_names_mlx_spec_mlx_and_mlx_lm():
    from importlib.metadata import version

    proc = mlx_spec_main("--version")
    assert proc.returncode == 0 and proc.stderr == ""
    expected = f"mlx-spec {mlx_spec.__version__} (mlx {version('mlx')}, mlx-lm {version('mlx-lm')})"
    assert proc.stdout == f"{expected}\n"


def test_no_subcommand_is_a_one_line_error():
    assert_one_line_error(mlx_spec_main(), "mlx-spec: error:", "COMMAND", "--help")


# -- generate ----------------------------------------------------------------------------------


def assert_drafted(drafted: int, n: int, rounds: int, generations: int = 1) -> None:
    """A round drafts ``n`` tokens unless fewer than ``n + 1`` are left to generate, which is so
    in at most the last ``n`` rounds of each generation."""
    assert n * (rounds - n * generations) <= drafted <= n * rounds


def test_generate_streams_text_and_consistent_counts():
    """Also the smoke test of the installed command: ``python -m mlx_spec generate``."""
    pair = ("--model", TARGET, "--draft-model", DRAFT, "--prompt", "def f(x):")
    proc = mlx_spec_cmd(
        "generate",
        *pair,
        "--temp",
        "0.8",
        "--top-p",
        "0.95",
        "-n",
        "3",
        "--max-tokens",
        "24",
        "--seed",
        "11",
        "--fixed",
    )
    assert proc.returncode == 0, proc.stderr
    assert generated_text(proc.stdout).strip()
    found = SPECULATION.search(proc.stdout)
    assert found["drafter"] == "draft model" and found["length"] == "fixed"
    n, rounds, drafted, accepted, rate, per_round = found.group(
        "n", "rounds", "drafted", "accepted", "rate", "per_round"
    )
    tokens = int(re.search(r"Generation: (\d+) tokens", proc.stdout).group(1))
    assert int(n) == 3
    assert_drafted(int(drafted), 3, int(rounds))
    assert 0 <= int(accepted) <= int(drafted)
    assert 1 <= tokens <= 24
    # Every round yields its accepted drafts and one token of the target's (or stops).
    assert int(rounds) <= tokens <= int(rounds) + int(accepted)
    # The printed ratios are the printed counts' (rounded as printed: a tie such as 18.75% is
    # printed 18.8, which an absolute tolerance of 0.05 missed by float rounding).
    assert f"{rate}%" == f"{int(accepted) / int(drafted):.1%}"
    assert per_round == f"{tokens / int(rounds):.2f}"


def test_kept_at_gives_each_draft_positions_share_of_kept_tokens():
    from mlx_spec.cli.generate import kept_at
    from mlx_spec.generation import SpeculativeStats

    stats = SpeculativeStats(drafted_at=[10, 8, 5], accepted_at=[8, 4, 1])
    assert kept_at(stats) == "Kept at draft position 1, 2, 3: 80%, 50%, 20%"
    # Past 8 positions the line says how many more there are, to stay short.
    stats = SpeculativeStats(drafted_at=[4] * 10, accepted_at=[4, 3, 3, 2, 2, 2, 1, 1, 1, 0])
    assert kept_at(stats) == (
        "Kept at draft position 1, 2, 3, 4, 5, 6, 7, 8: "
        "100%, 75%, 75%, 50%, 50%, 50%, 25%, 25% (and 2 later positions)"
    )


def test_generate_prints_how_often_each_draft_position_was_kept(monkeypatch):
    # The line after the counts, checked against the counts of the generation's own stats.
    from mlx_spec import generation

    made = []

    class Recorded(generation.SpeculativeStats):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(generation, "SpeculativeStats", Recorded)
    proc = generate("--temp", "0", "-n", "3", "--max-tokens", "24", "--fixed")
    assert proc.returncode == 0, proc.stderr
    stats = made[0]  # the command's own; the responses carry snapshots of it
    found = SPECULATION.search(proc.stdout)
    assert int(found["drafted"]) == stats.drafted == sum(stats.drafted_at) > 0
    assert int(found["accepted"]) == stats.accepted == sum(stats.accepted_at)
    kept = re.search(r"^Kept at draft position 1, 2, 3: (\d+)%, (\d+)%, (\d+)%$", proc.stdout, re.M)
    assert kept, proc.stdout
    assert [int(v) for v in kept.groups()] == [
        round(100 * a / d) for a, d in zip(stats.accepted_at, stats.drafted_at, strict=True)
    ]


def test_generate_with_a_seed_is_reproducible():
    # With a fixed draft length: adaptive lengths follow measured times, and the text sampled
    # with a key depends on how the rounds fall.
    args = ("--temp", "1.0", "--max-tokens", "16", "--seed", "7", "--fixed")
    first, second = generate(*args), generate(*args)
    assert first.returncode == second.returncode == 0
    assert generated_text(first.stdout) == generated_text(second.stdout)
    assert SPECULATION.search(first.stdout).groups() == SPECULATION.search(second.stdout).groups()


def test_greedy_generate_prints_the_targets_greedy_text():
    """At temperature 0 speculation is lossless: the text is plain greedy decoding's."""
    from mlx_lm import generate as mlx_lm_generate
    from mlx_lm import load

    prompt = "class Queue:\n    def put(self, item):\n"
    proc = generate("--temp", "0", "-n", "2", "--max-tokens", "24", prompt=prompt)
    assert proc.returncode == 0, proc.stderr
    model, tokenizer = load(TARGET)
    expected = mlx_lm_generate(model, tokenizer, prompt, max_tokens=24)
    assert generated_text(proc.stdout) == expected


def lookup(*extra: str, model: str = TARGET, prompt: str = "def f(x):"):
    return mlx_spec_main(
        "generate", "--model", model, "--prompt-lookup", "--prompt", prompt, *extra
    )


def test_prompt_lookup_needs_no_draft_model_and_is_lossless():
    from mlx_lm import generate as mlx_lm_generate
    from mlx_lm import load

    code = "def area(r):\n    return 3.14 * r * r\n\n"
    prompt = code * 2 + "def area(r):\n"
    proc = lookup("--temp", "0", "--max-tokens", "40", "--ignore-chat-template", prompt=prompt)
    assert proc.returncode == 0, proc.stderr
    found = SPECULATION.search(proc.stdout)
    assert found["drafter"] == "prompt lookup" and found["length"] == "adaptive, at most"
    model, tokenizer = load(TARGET)
    assert generated_text(proc.stdout) == mlx_lm_generate(model, tokenizer, prompt, max_tokens=40)


@pytest.fixture(scope="module")
def hybrid_folder(tmp_path_factory) -> str:
    """A tiny qwen3_next hybrid (recurrent and attention layers) with the demo's tokenizer."""
    from tiny_models import save_model_folder, tiny_qwen3_next

    folder = tmp_path_factory.mktemp("hybrid") / "model"
    save_model_folder(tiny_qwen3_next(0, vocab=4096), folder, tokenizer_from=Path(TARGET))
    return str(folder)


@pytest.mark.parametrize("drafts", ["--prompt-lookup", "--draft-model"])
def test_a_hybrid_model_speculates_through_the_command(hybrid_folder, drafts):
    from mlx_lm import generate as mlx_lm_generate
    from mlx_lm import load

    extra = ["--prompt-lookup"] if drafts == "--prompt-lookup" else ["--draft-model", hybrid_folder]
    prompt = "def f(x):\n    return x\n\ndef f(x):\n"
    proc = mlx_spec_main(
        "generate", "--model", hybrid_folder, "--prompt", prompt, *extra,
        "--temp", "0", "--max-tokens", "30", "--fixed", "-n", "3",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    model, tokenizer = load(hybrid_folder)
    expected = mlx_lm_generate(model, tokenizer, prompt, max_tokens=30)
    assert generated_text(proc.stdout) == expected
    assert int(SPECULATION.search(proc.stdout)["drafted"]) > 0


def test_max_kv_size_reaches_the_loop():
    from mlx_lm import generate as mlx_lm_generate
    from mlx_lm import load

    prompt = "class Queue:\n    def put(self, item):\n"
    proc = generate("--temp", "0", "--max-tokens", "24", "--max-kv-size", "64", prompt=prompt)
    assert proc.returncode == 0, proc.stderr
    model, tokenizer = load(TARGET)
    expected = mlx_lm_generate(model, tokenizer, prompt, max_tokens=24, max_kv_size=64)
    assert generated_text(proc.stdout) == expected


@pytest.mark.parametrize("drafts", [["--prompt-lookup"], ["--draft-model", DRAFT]])
def test_kv_bits_with_max_kv_size_is_refused(drafts):
    # The guide says they do not combine: mlx-lm has no quantized rotating cache. Refused before
    # the models load: the target folder does not exist.
    proc = mlx_spec_main(
        "generate", "--model", "nowhere", *drafts, "--prompt", "x", *KV_BITS_AND_SIZE
    )
    assert_one_line_error(
        proc, "mlx-spec generate: error: --kv-bits and --max-kv-size do not combine", "give one"
    )


@pytest.mark.parametrize("drafts", [["--prompt-lookup"], ["--draft-model", DRAFT]])
def test_an_empty_prompt_is_a_one_line_error_saying_what_to_do(drafts):
    proc = mlx_spec_main("generate", "--model", TARGET, *drafts, "--prompt", "")
    assert_one_line_error(
        proc, "mlx-spec generate: error: argument --prompt: is empty; give the text to continue"
    )


@pytest.mark.parametrize("drafts", [["--prompt-lookup"], ["--draft-model", DRAFT]])
def test_a_generation_that_drafted_nothing_says_so(drafts):
    # One token: its round has no token left after it to verify a draft against.
    proc = mlx_spec_main(
        "generate", "--model", TARGET, *drafts, "--prompt", "def f(x):", "--max-tokens", "1"
    )
    assert proc.returncode == 0, proc.stderr
    assert "acceptance rate" not in proc.stdout and "Kept at" not in proc.stdout
    found = NOTHING_DRAFTED.search(proc.stdout)
    assert found and (found["rounds"], found["per_round"]) == ("1", "1.00"), proc.stdout


def test_kv_bits_reaches_the_loop(tmp_path):
    # The demo pair quantizes only past mlx-lm's 5000-token start, so its text cannot show that
    # --kv-bits got through; the loop's refusal to quantize a sliding-window cache can.
    from tiny_models import save_model_folder, tiny_gemma3

    folder = tmp_path / "gemma3"
    save_model_folder(tiny_gemma3(0, vocab=4096), folder, tokenizer_from=Path(TARGET))
    proc = mlx_spec_main(
        "generate", "--model", str(folder), "--prompt-lookup", "--prompt", "x", "--kv-bits", "4"
    )
    assert_one_line_error(proc, "`kv_bits` cannot quantize a RotatingKVCache")


@pytest.mark.parametrize("bits", ["0", "1", "7", "9", "4.0"])
def test_kv_bits_takes_only_the_widths_mlx_lm_quantizes_to(bits):
    # Refused by the parser, before any model is loaded: the model folder does not exist.
    proc = mlx_spec_main("generate", "--model", "nowhere", "--prompt-lookup", "--prompt", "x",
                        "--kv-bits", bits)  # fmt: skip
    assert_one_line_error(proc, "argument --kv-bits:", f"got '{bits}'")


def test_draft_model_and_prompt_lookup_exclude_each_other():
    both = mlx_spec_main(
        "generate", "--model", TARGET, "--draft-model", DRAFT, "--prompt-lookup", "--prompt", "x"
    )
    assert_one_line_error(both, "not allowed with argument")
    neither = mlx_spec_main("generate", "--model", TARGET, "--prompt", "x")
    assert_one_line_error(neither, "one of the arguments --draft-model --prompt-lookup")


# -- errors ------------------------------------------------------------------------------------


def test_missing_model_folder(tmp_path):
    missing = str(tmp_path / "no-such-model")
    line = assert_one_line_error(generate(model=missing), "target model folder not found")
    assert missing in line


def test_missing_draft_folder(tmp_path):
    missing = str(tmp_path / "nowhere" / "draft")
    assert_one_line_error(generate(draft=missing), "draft model folder not found", missing)


def test_folder_without_a_model(tmp_path):
    assert_one_line_error(generate(draft=str(tmp_path)), "not an mlx-lm model folder")


def test_model_folder_whose_name_is_too_long(tmp_path):
    name = str(tmp_path / ("m" * 5000))
    assert_one_line_error(generate(model=name), "cannot read the target model folder", "...")


def test_model_folder_of_an_unknown_user():
    """pathlib cannot expand ~nosuchuser (it raises); it is a folder that is not there."""
    assert_one_line_error(generate(draft="~no-such-user/model"), "draft model folder not found")


def test_a_name_mlx_lm_cannot_resolve_offline(tmp_path):
    with offline(tmp_path):
        proc = generate(draft="no-such-org/no-such-model")
    assert_one_line_error(proc, "could not load the draft model", "no-such-org/no-such-model")


def _draft_copy(tmp_path: Path, edit) -> str:
    folder = tmp_path / "draft"
    shutil.copytree(DRAFT, folder)
    path = folder / "tokenizer.json"
    tokenizer = json.loads(path.read_text())
    edit(tokenizer)
    path.write_text(json.dumps(tokenizer))
    return str(folder)


def test_draft_with_a_larger_vocabulary(tmp_path):
    def add_token(tokenizer):
        tokenizer["added_tokens"].append(
            {
                "id": 4096,
                "content": "<|extra|>",
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
        )

    proc = generate(draft=_draft_copy(tmp_path, add_token))
    assert_one_line_error(proc, "4096 tokens", "4097", "vocabulary sizes differ")


def test_draft_with_another_tokenizer_of_the_same_size(tmp_path):
    def swap_two_ids(tokenizer):
        vocab = tokenizer["model"]["vocab"]
        a, b = sorted(vocab, key=vocab.get)[300:302]
        vocab[a], vocab[b] = vocab[b], vocab[a]

    proc = generate(draft=_draft_copy(tmp_path, swap_two_ids))
    assert_one_line_error(proc, "different tokenizers", "2 of 4096 tokens")


def test_a_state_space_draft_is_rolled_back_by_its_checkpoints(tmp_path):
    """A mamba draft: its recurrent caches cannot be trimmed, so they are restored from the
    checkpoints taken at each draft step, and the text is still the target's greedy text."""
    from mlx_lm import generate as mlx_lm_generate
    from mlx_lm import load
    from mlx_lm.models import mamba

    config = {
        "model_type": "mamba",
        "vocab_size": 4096,
        "hidden_size": 16,
        "intermediate_size": 32,
        "state_size": 4,
        "num_hidden_layers": 1,
        "conv_kernel": 4,
        "use_bias": False,
        "use_conv_bias": True,
        "time_step_rank": 4,
    }
    folder = tmp_path / "mamba"
    folder.mkdir()
    model = mamba.Model(mamba.ModelArgs(**config))
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (folder / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO / "draft" / name, folder / name)
    prompt = "class Queue:\n    def put(self, item):\n"
    proc = generate(
        "--temp", "0", "--max-tokens", "24", "--fixed", draft=str(folder), prompt=prompt
    )
    assert proc.returncode == 0, proc.stderr
    model, tokenizer = load(TARGET)
    assert generated_text(proc.stdout) == mlx_lm_generate(model, tokenizer, prompt, max_tokens=24)
    assert int(SPECULATION.search(proc.stdout)["drafted"]) > 0


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["--temp", "-1"], ["--temp", "must be >= 0", "-1"]),
        (["--temp", "nan"], ["--temp", "finite"]),
        (["--temp", "hot"], ["--temp", "expected a number", "hot"]),
        (["--top-p", "1.5"], ["--top-p", "[0, 1]", "1.5"]),
        (["--min-p", "-0.1"], ["--min-p", "[0, 1]"]),
        (["--temp", "1e309"], ["--temp", "finite"]),
        (["--top-p", "inf"], ["--top-p", "finite"]),
        (["--top-k", "-2"], ["--top-k", "must be >= 0"]),
        (["--num-draft-tokens", "0"], ["--num-draft-tokens", "must be in [1, 64]", "0"]),
        (["-n", "65"], ["--num-draft-tokens", "must be in [1, 64]", "65"]),
        (["-n", "100000"], ["--num-draft-tokens", "must be in [1, 64]", "100000"]),
        (["-n", "1.5"], ["expected an integer"]),
        (["--max-tokens", "0"], ["--max-tokens", "must be in [1, 1000000]"]),
        (["--max-tokens", "1000001"], ["--max-tokens", "must be in [1, 1000000]"]),
        (["--max-tokens", "9" * 5000], ["--max-tokens", "expected an integer", "999..."]),
        (["--seed", "-3"], ["--seed", "must be in [0, 18446744073709551615]"]),
        (["--seed", str(2**64)], ["--seed", "must be in [0, 18446744073709551615]"]),
        (["--seed", "1.5"], ["--seed", "expected an integer"]),
        (["--prompt", "caf\udce9"], ["--prompt", "not UTF-8", "bytes e9 at character 3"]),
        (["--prompt", "\udcff\udcfe"], ["--prompt", "not UTF-8", "bytes ff fe at character 0"]),
        (["--model", "models/\udcff"], ["--model", "not UTF-8"]),
        (["--draft-model", "\udc80"], ["--draft-model", "not UTF-8"]),
    ],
)
def test_bad_generate_option(args, fragments):
    """Bad values, out-of-range and non-finite numbers, and arguments that are not UTF-8
    (Python hands their bytes over as lone surrogates, as here)."""
    proc = generate(*args)
    line = assert_one_line_error(proc, "mlx-spec generate: error:", "--help", *fragments)
    assert len(line) < 400, "a long value is cut short in the message"


@pytest.mark.parametrize(
    "args",
    [
        ["--seed", str(2**64 - 1), "-n", "64", "--max-tokens", "3"],
        ["--seed", "0", "-n", "1", "--max-tokens", "1"],
    ],
)
def test_generate_takes_the_bounds_of_its_options(args):
    proc = generate(*args)
    assert proc.returncode == 0, proc.stderr
    assert f"seed {args[1]}" in proc.stdout


def test_generate_needs_its_models():
    proc = mlx_spec_main("generate", "--prompt", "hi")
    assert_one_line_error(proc, "required", "--model")


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["demo", "--max-tokens", "0"], ["--max-tokens", "must be in [1, 1000000]"]),
        (["demo", "--max-tokens", "1000001"], ["--max-tokens", "must be in [1, 1000000]"]),
        (["demo", "-n", "0"], ["--num-draft-tokens", "must be in [1, 64]"]),
        (["demo", "-n", "65"], ["--num-draft-tokens", "must be in [1, 64]"]),
        (["demo", "--seed", str(2**64)], ["--seed", "must be in [0, 18446744073709551615]"]),
        (["demo", "--seed", "-1"], ["--seed", "must be in [0, 18446744073709551615]"]),
        (["demo", "--repeats", "1"], ["--repeats", "must be in [2, 50] (a range needs two runs)"]),
        (["demo", "--repeats", "51"], ["--repeats", "must be in [2, 50]"]),
        (["demo", "--color", "pink"], ["--color", "invalid choice"]),
        (["demo", "--fixed=yes"], ["--fixed", "ignored explicit argument"]),
        (["bench", "--frobnicate"], ["unrecognized arguments", "--frobnicate"]),
        (["bench", "--out", ""], ["--out", "expected a folder"]),
        (["bench", "--out", "out-\udcff"], ["--out", "not UTF-8", "bytes ff at character 4"]),
    ],
)
def test_bad_demo_and_bench_options(args, fragments):
    assert_one_line_error(mlx_spec_main(*args), *fragments)


def can_write_in(folder: Path) -> bool:
    try:
        with tempfile.TemporaryFile(dir=folder):
            return True
    except OSError:
        return False


@pytest.fixture
def unwritable_folder(tmp_path) -> Path:
    """An existing folder no file can be created in: a read-only one, or, for root (whom
    permissions do not stop), /sys; skips where neither holds."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    for candidate in (folder, Path("/sys")):
        if candidate.is_dir() and not can_write_in(candidate):
            return candidate
    pytest.skip("no folder here refuses new files")


def test_bench_out_is_a_file(tmp_path):
    file = tmp_path / "results"
    file.write_text("")
    assert_one_line_error(mlx_spec_main("bench", "--out", str(file)), "is a file", "folder")


def test_bench_out_that_cannot_be_written_fails_before_measuring(unwritable_folder):
    proc = mlx_spec_main("bench", "--quick", "--out", str(unwritable_folder))
    assert_one_line_error(proc, "cannot write in --out", str(unwritable_folder))


@pytest.mark.parametrize("parent", ["unwritable", "file"])
def test_bench_out_that_cannot_be_created(parent, unwritable_folder, tmp_path):
    if parent == "file":
        (tmp_path / "file").write_text("")
    under = unwritable_folder if parent == "unwritable" else tmp_path / "file"
    proc = mlx_spec_main("bench", "--quick", "--out", str(under / "out"))
    assert_one_line_error(proc, "cannot create --out", str(under / "out"))


def test_bench_out_whose_name_is_too_long(tmp_path):
    out = str(tmp_path / ("o" * 5000))
    assert_one_line_error(mlx_spec_main("bench", "--out", out), "cannot create --out", "...")


def test_bench_results_json_that_cannot_be_written_fails_before_measuring(tmp_path):
    (tmp_path / "results.json").mkdir()
    proc = mlx_spec_main("bench", "--quick", "--out", str(tmp_path))
    assert_one_line_error(proc, str(tmp_path / "results.json"))


def test_a_message_of_several_lines_is_printed_as_one(capsys):
    from mlx_spec.cli._common import CliError, Parser, run

    def body(_):
        raise CliError("first line\nsecond line")

    assert run(Parser(prog="mlx-spec test"), body, []) == 2
    assert capsys.readouterr().err == "mlx-spec test: error: first line second line\n"


# -- a closed pipe -----------------------------------------------------------------------------


def closed_pipe_run(*args: str, read: int = 0) -> tuple[int, str]:
    """Runs ``python -m mlx_spec *args``, reads ``read`` bytes of its stdout and closes it, as
    ``head -c`` does; returns the exit status and stderr. stdout is buffered, as a user's is
    (not under PYTHONUNBUFFERED), so a closed pipe can first show when Python flushes it."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlx_spec", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    try:
        assert len(proc.stdout.read(read)) == read
        proc.stdout.close()
        stderr = proc.stderr.read().decode()
        return proc.wait(timeout=300), stderr
    finally:
        proc.kill()


@pytest.mark.parametrize(
    "args",
    [
        # Closed before anything is written: the output stays in Python's buffer until exit.
        ("--help",),
        ("generate", "--help"),
        ("generate", "--model", TARGET, "--draft-model", DRAFT, "--prompt", "def f(x):", "-m", "4"),
    ],
)
def test_a_closed_pipe_ends_the_command_quietly(args):
    status, stderr = closed_pipe_run(*args)
    assert (status, stderr) == (141, "")


def test_a_pipe_closed_while_generate_streams_ends_it_quietly():
    args = ("--prompt", "class Queue:\n", "--temp", "0", "-m", "400")
    status, stderr = closed_pipe_run(
        "generate", "--model", TARGET, "--draft-model", DRAFT, *args, read=10
    )
    assert (status, stderr) == (141, "")


# -- demo --------------------------------------------------------------------------------------

PROMPT_SHOWN = re.compile(r"^=== (input-grounded|open) prompt ===\n(.*?)\n--- ", re.M | re.S)
STREAM = re.compile(
    r"^--- (input-grounded|open), temperature (0\.0|0\.8), (draft model|prompt lookup|MTP head), "
    r"(?:N adaptive, at most (\d+)|N = (\d+), fixed) ---\n(.*?)\n--- (\d+) tokens in (\d+) "
    r"rounds, (\d+) of (\d+) draft tokens accepted, ([\d.]+) tokens per round ---$",
    re.M | re.S,
)
ANSI_MARK = re.compile(r"\x1b\[(?:32|0)m")
TEMPS = ("0.0", "0.8")
WORKLOADS = ("input-grounded", "open")
DRAFTERS = {"draft model": "draft", "prompt lookup": "lookup", "MTP head": "mtp"}
"""The drafters the demo streams (the shipped target has an MTP head), and their methods' names."""


def mlx_lm_command_default_n() -> int:
    """The draft length of mlx-lm's own ``mlx_lm.generate`` command."""
    import importlib

    return (
        importlib.import_module("mlx_lm.generate")
        .setup_arg_parser()
        .get_default("num_draft_tokens")
    )


def check_demo_streams(stdout: str, n: int, fixed: bool, max_tokens: int) -> dict:
    """Every drafter streams on both prompts at both temperatures with consistent counts;
    returns each stream's text (marks removed) by (workload, temperature, drafter)."""
    streams = STREAM.findall(stdout)
    assert [s[:3] for s in streams] == [
        (w, t, d) for w in WORKLOADS for t in TEMPS for d in DRAFTERS
    ], stdout
    texts = {}
    for workload, temp, drafter, most, exact, text, *counts in streams:
        tokens, rounds, accepted, drafted = (int(c) for c in counts[:4])
        assert int(exact or most) == n and bool(exact) == fixed
        assert 1 <= rounds <= tokens <= min(max_tokens, rounds + accepted)
        assert 0 <= accepted <= drafted <= n * rounds
        if fixed and drafter != "prompt lookup":
            assert_drafted(drafted, n, rounds)
        assert counts[4] == f"{tokens / rounds:.2f}"
        marked = ANSI_MARK.search(text) or "[" in text
        assert marked or not accepted, text
        texts[workload, temp, drafter] = ANSI_MARK.sub("", text)
    # The input-grounded prompt repeats itself: prompt lookup finds drafts the target keeps.
    grounded = streams[1]
    assert grounded[:3] == ("input-grounded", "0.0", "prompt lookup")
    assert int(grounded[8]) > 0, grounded
    return texts


def check_greedy_streams_are_the_targets_greedy_text(stdout: str, texts: dict, max_tokens: int):
    """At temperature 0 every drafter prints plain greedy decoding's text of the prompt shown."""
    from mlx_lm import generate as mlx_lm_generate
    from mlx_lm import load

    prompts = dict(PROMPT_SHOWN.findall(stdout))
    assert set(prompts) == set(WORKLOADS)
    model, tokenizer = load(TARGET)
    for workload, prompt in prompts.items():
        expected = mlx_lm_generate(model, tokenizer, prompt, max_tokens=max_tokens)
        for drafter in DRAFTERS:
            assert texts[workload, "0.0", drafter] == expected, (workload, drafter)


def check_demo_table(stdout: str, n: int, fixed: bool, lm_n: int) -> list[dict[str, str]]:
    """A line per prompt, temperature and method: plain decoding, mlx-lm's loop at ``lm_n`` and
    mlx-spec with each drafter at ``n``, fixed or adaptive; tok/s and x plain as the median and
    range of the runs, ratios that divide the printed tok/s."""
    length = f"N={n}" if fixed else "adaptive"
    methods = ["plain", f"mlx-lm N={lm_n}", *(f"{m} {length}" for m in DRAFTERS.values())]
    table = markdown_table(stdout, "workload")
    assert [(r["workload"], r["temp"], r["method"]) for r in table] == [
        (w, t, m) for w in WORKLOADS for t in TEMPS for m in methods
    ]
    assert_spread_cells(table)
    for line in table:
        group = {
            r["method"]: r
            for r in table
            if (r["workload"], r["temp"]) == (line["workload"], line["temp"])
        }
        speed = spread_cell(line["tok/s"])[0]
        assert line["x best fixed N"] == "-"
        if line["method"] == "plain":
            assert (line["tok/round"], line["acceptance"], line["x plain"]) == (
                "1.00",
                "-",
                "1.00x (1.00x-1.00x)",
            )
            continue
        most = lm_n if line["method"].startswith("mlx-lm") else n
        assert 1.0 <= float(line["tok/round"]) <= most + 1
        if line["acceptance"] == "-":  # nothing drafted: every round a plain step
            assert line["tok/round"] == "1.00"
        else:
            assert 0.0 <= float(line["acceptance"].rstrip("%")) <= 100.0
        if fixed and line["method"] == f"draft N={n}":
            theirs = spread_cell(group[f"mlx-lm N={n}"]["tok/s"])[0]
            assert_ratio(line["x mlx-lm"], speed, theirs)
            if line["temp"] == "0.0":
                # Both loops are greedy acceptance: the same drafts kept, the same rounds.
                assert line["tok/round"] == group[f"mlx-lm N={n}"]["tok/round"]
        else:
            assert line["x mlx-lm"] == "-"
    return table


NOISE_LINE = re.compile(
    r"^(Quiet enough for a verdict: plain decoding's tokens/s spread by at most \d+%|Too noisy for "
    r"a verdict in (\d) of 4 cases: plain decoding's tokens/s spread by up to \d+%) of its median "
    r"over (\d+) repeats \(a verdict needs at most 10%\)",
    re.M,
)
VERDICT = re.compile(r"^- (draft model|prompt lookup|MTP head), (adaptive|N=\d+): (.*)$", re.M)
CASE = re.compile(
    r"(?:(input-grounded|open) )?t=(0\.0|0\.8) (too noisy to tell|slower at [\d.]+x \(([\d.]+)x-"
    r"([\d.]+)x\)|no faster \(([\d.]+)x-([\d.]+)x\)|([\d.]+)x \(([\d.]+)x-([\d.]+)x\))"
)


def check_verdicts(stdout: str, table: list[dict[str, str]], length: str, repeats: int) -> None:
    """One line on the noise, then a verdict per drafter whose cases agree with the table's x
    plain: faster where every run was, slower where every run was, no faster where the range
    holds 1, too noisy where the noise line says so."""
    (noise,) = NOISE_LINE.findall(stdout)
    assert int(noise[2]) == repeats
    noisy = int(noise[1] or 0)
    verdicts = VERDICT.findall(stdout)
    assert [(d, length_) for d, length_, _ in verdicts] == [(d, length) for d in DRAFTERS]
    x_plain = {(r["workload"], r["temp"], r["method"]): r["x plain"] for r in table}
    for drafter, _, said in verdicts:
        method = f"{DRAFTERS[drafter]} {length}"
        if said == "too noisy to tell":
            continue
        if said == "no faster than plain decoding here":
            for (_, _, name), cell in x_plain.items():
                if name == method:
                    low, high = spread_cell(cell)[1:]
                    assert low <= 1.0 <= high, (method, cell)
            continue
        workload = None
        cases = CASE.findall(said)
        assert len(cases) == 4, said
        for case in cases:
            workload = case[0] or workload
            median, low, high = spread_cell(x_plain[workload, case[1], method])
            words = case[2]
            if words == "too noisy to tell":
                assert noisy or low <= 1.0 <= high, (said, median, low, high)
            # The table prints ratios to two decimals: a range that ends below 1 may show 1.00.
            elif words.startswith("slower"):
                assert high <= 1.0 and words == f"slower at {x_plain[workload, case[1], method]}"
            elif words.startswith("no faster"):
                assert low <= 1.0 <= high
            else:
                assert low >= 1.0 and words == x_plain[workload, case[1], method]


def shipped_model_facts(role: str) -> str:
    """How the demo describes a shipped model, from its config and its weights on disk."""
    config = json.loads((DEMO / role / "config.json").read_text())
    size = sum(a.size for a in mx.load(str(DEMO / role / "model.safetensors")).values())
    return (
        f"a {config['num_hidden_layers']}-layer, {config['hidden_size']}-wide {role} "
        f"({size / 1e6:.1f}M parameters)"
    )


def demo(monkeypatch, *args: str) -> tuple[Ran, list[dict]]:
    """``mlx-spec demo *args`` in this process; returns what it printed and the rows it
    measured."""
    from mlx_spec import bench

    measured = []

    def measure(*a, **k):
        measured.extend(bench_measure(*a, **k))
        return measured

    bench_measure = bench.measure
    monkeypatch.setattr(bench, "measure", measure)
    return mlx_spec_main("demo", *args), measured


def check_progress(stderr: str, total: int) -> None:
    """A line per method and prompt of each run (stderr is not a terminal), counted to the
    total, then ``done``."""
    steps = re.findall(r"^\[[#.]{20}\] (\d+)/(\d+) (\S+(?: N=\d+| adaptive)?), ", stderr, re.M)
    assert [(int(k), int(t)) for k, t, _ in steps] == [(k, total) for k in range(1, total + 1)]
    assert stderr.rstrip().endswith("] done"), stderr[-200:]


@pytest.mark.slow  # the quick suite runs the default demo, as a user does
def test_demo_fixed_drafts_n_every_round_and_compares_mlx_lm_at_n(monkeypatch):
    # 8 tokens: with the MTP head the demo measures five methods, and 8 keep the time of four.
    args = ("--max-tokens", "8", "-n", "3", "--fixed", "--color", "never", "--repeats", "2")
    proc, rows = demo(monkeypatch, *args, "--seed", str(2**64 - 1))
    assert proc.returncode == 0, proc.stderr
    check_demo_streams(proc.stdout, 3, True, 8)
    table = check_demo_table(proc.stdout, 3, True, 3)
    assert_spread_table(proc.stdout, rows)
    check_verdicts(proc.stdout, table, "N=3", 2)
    assert "\x1b[" not in proc.stdout and "shown in [brackets]" in proc.stdout


def test_demo_by_default_adapts_up_to_8_and_runs_mlx_lm_at_its_commands_n():
    """Also the smoke test of the installed command: ``python -m mlx_spec demo`` with colours,
    as on a terminal, and 2 runs a method (its default is the user's); it streams both drafters
    on both prompts, then the table."""
    proc = mlx_spec_cmd("demo", "--max-tokens", "4", "--color", "always", "--repeats", "2")
    assert proc.returncode == 0, proc.stderr
    texts = check_demo_streams(proc.stdout, 8, False, 4)
    check_greedy_streams_are_the_targets_greedy_text(proc.stdout, texts, 4)
    table = check_demo_table(proc.stdout, 8, False, min(8, mlx_lm_command_default_n()))
    check_verdicts(proc.stdout, table, "adaptive", 2)
    check_progress(proc.stderr, 2 * 2 * 5 * 2)  # workloads, temperatures, methods, runs
    assert "the median of the 2 steady runs" in proc.stdout
    assert "\x1b[32m" in proc.stdout and "shown in green" in proc.stdout
    first = proc.stdout.splitlines()[0]
    assert f"{shipped_model_facts('target')} and {shipped_model_facts('draft')}" in first
    config = json.loads((DEMO / "target" / "config.json").read_text())
    assert f"{config['dtype']}, sharing one {config['vocab_size']}-token tokenizer" in first


def test_marker_colours_runs_of_draft_tokens(monkeypatch):
    from mlx_spec.cli.demo import _Marker

    for color, (left, right) in ((True, ("\x1b[32m", "\x1b[0m")), (False, ("[", "]"))):
        out = io.StringIO()
        monkeypatch.setattr(sys, "stdout", out)
        marker = _Marker(color)
        for text, from_draft in [("a", False), ("b", True), ("c", True), ("", False), ("d", False)]:
            marker.write(text, from_draft)
        marker.write("e", True)
        marker.end()
        assert out.getvalue() == f"a{left}bc{right}d{left}e{right}\n"


# -- bench -------------------------------------------------------------------------------------

SMALL = {"drafts": (2,), "prompts": 1, "max_tokens": 8, "repeats": 2}
"""A smaller ``--quick`` for the suite: every method, workload and temperature, fewer tokens and
repeats (8 tokens: with the MTP head's two methods, the time of 12 without them)."""


# The quick suite runs the bench in test_interrupted_bench_keeps_what_it_measured (to its first
# row); every row, the table and the plot are checked here, in the full suite.
@pytest.mark.slow
def test_bench_quick_writes_results_a_consistent_table_and_a_plot(tmp_path, monkeypatch):
    """``--quick`` made smaller in this process: :data:`SMALL`, and as input-grounded prompt the
    demo's, a third the length of the benchmark's first (on a CPU its prefill dominates short
    generations)."""
    from mlx_spec import _demo, bench
    from mlx_spec.cli import bench as command

    monkeypatch.setitem(command.SETTINGS, True, SMALL)
    monkeypatch.setattr(bench, "GROUNDED", _demo.GROUNDED[1:2])
    out = tmp_path / "bench"
    proc = mlx_spec_main("bench", "--quick", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    results = json.loads((out / "results.json").read_text())
    settings, rows = results["settings"], results["generation"]
    assert settings["quick"] is True and settings["repeats"] == SMALL["repeats"]
    assert {"date", "system", "mlx", "mlx_lm", "device"} <= set(results["machine"])
    names = ["plain", "mlx-lm N=2", "draft N=2", "draft adaptive", "lookup N=2", "lookup adaptive"]
    names += ["mtp N=2", "mtp adaptive"]  # the shipped target has an MTP head
    assert [r["name"] for r in rows[: 2 * len(names) : 2]] == names
    assert len(rows) == 2 * len(settings["temps"]) * len(names) * 2  # workloads, phases
    for row in rows:
        # The first runs are the first pass's; the steady ones every pass's.
        assert row["repeats"] == (1 if row["phase"] == "first" else settings["repeats"])
        assert len(row["tokens_per_second_by_repeat"]) == row["repeats"]
        tokens = settings["prompts"] * settings["max_tokens"] * row["repeats"]
        assert row["generated"] == tokens and row["rounds"] <= tokens
        if row["drafter"] == "plain":
            assert row["rounds"] == tokens
        elif row["adaptive"] or row["drafter"] == "lookup":
            assert row["drafted"] <= row["n"] * row["rounds"]
        else:
            generations = settings["prompts"] * row["repeats"]
            assert_drafted(row["drafted"], row["n"], row["rounds"], generations)
    by = {(r["workload"], r["temp"], r["name"], r["phase"]): r for r in rows}
    for (workload, temp, name, phase), row in by.items():
        if temp == 0 and name == "draft N=2":  # the same drafts, kept alike
            assert row["rounds"] == by[workload, temp, "mlx-lm N=2", phase]["rounds"]
        if temp == 0 and name == "mtp N=2":  # the trained head's greedy guesses are kept
            assert row["accepted"] > 0, row
    assert_spread_table(proc.stdout, rows)
    verdicts = VERDICT.findall(proc.stdout)
    assert [(d, length) for d, length, _ in verdicts] == [(d, "adaptive") for d in DRAFTERS]
    assert len(NOISE_LINE.findall(proc.stdout)) == 1
    assert str(out / "results.json") in proc.stdout
    check_progress(proc.stderr, 2 * 2 * len(names) * SMALL["repeats"])
    assert f"Wrote {out / 'plot.png'}: tokens/s against tokens per round" in proc.stdout
    assert (out / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_without_matplotlib_says_how_to_get_the_plot(tmp_path, monkeypatch):
    from mlx_spec import bench
    from mlx_spec.cli.bench import _plot

    lines = bench.summarize(bench_rows({"plain": [10, 10.2, 9.9], "lookup adaptive": [14, 15, 13]}))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    said = _plot(lines, tmp_path, "title")
    assert said == (
        f"pip install matplotlib gives {tmp_path / 'plot.png'} (tokens/s against tokens per round)"
    )
    assert not (tmp_path / "plot.png").exists()
    monkeypatch.delitem(sys.modules, "matplotlib")  # the control: with it, the plot is drawn
    assert _plot(lines, tmp_path, "title").startswith("Wrote")
    assert (tmp_path / "plot.png").exists()


def test_bench_is_an_installed_command():
    """The smoke test of ``python -m mlx_spec bench``: the command starts and describes itself
    (the tests above and below run its ``main``)."""
    proc = mlx_spec_cmd("bench", "--help", timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: mlx-spec bench") and "--quick" in proc.stdout


def test_interrupted_bench_keeps_what_it_measured(tmp_path):
    """results.json is rewritten after each measured row: Ctrl-C loses none of them. The
    command's ``main`` runs in a process of its own (a real SIGINT), with :data:`SMALL` as
    ``--quick``'s settings and the demo's short input-grounded prompt, as the test above, so that
    its first row comes within seconds; with progress."""
    results = tmp_path / "results.json"
    program = (
        "import sys\n"
        "from mlx_spec import _demo, bench\n"
        "from mlx_spec.cli import bench as command, main\n"
        f"command.SETTINGS[True] = {SMALL!r}\n"
        "bench.GROUNDED = _demo.GROUNDED[1:2]\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", program, "bench", "--quick", "--out", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        while not (results.exists() and json.loads(results.read_text())["generation"]):
            assert proc.poll() is None and time.monotonic() < deadline, "no row was written"
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    kept = json.loads(results.read_text())
    assert kept["settings"]["quick"] is True
    first = kept["generation"][0]
    assert first["workload"] == "input-grounded" and first["tokens_per_second"] > 0
    assert re.search(r"^\[\.{20}\] loading the demo pair, warm-up$", stderr, re.M), stderr
    first_step = r"^\[[#.]{20}\] 1/\d+ plain, input-grounded, t=0.0, repeat 1/\d$"
    assert re.search(first_step, stderr, re.M), stderr


# -- fuzzing -----------------------------------------------------------------------------------
# Bad values for every option of each command, each run with a time limit: the command must end
# with status 2 and one line on stderr, or succeed; never an exception or a hang. Each run stops
# where a good value would start real work, so many fit in the quick suite.


def not_utf8(data: bytes) -> str:
    """An argument of these bytes as Python hands it over: undecodable bytes become surrogates."""
    return data.decode("utf-8", "surrogateescape")


def no_nul(text: str) -> bool:
    return "\x00" not in text  # no process argument can hold one


BAD_VALUES = st.one_of(
    st.sampled_from(
        [
            *("", " ", "-0", "0", "-1", "1.5", "1e309", "nan", "-inf", "1_000", "0x10", "٣"),
            *("64", "65", "1000001", str(2**64 - 1), str(2**64), "9" * 5000),
        ]
    ),
    st.integers(min_value=-(2**80), max_value=2**80).map(str),
    st.floats().map(repr),
    st.text(max_size=12).filter(no_nul),
    st.binary(min_size=1, max_size=6).map(not_utf8).filter(no_nul),
)
"""Numbers of every size, sign and kind (NaN, inf), words, and text that is not UTF-8."""


def drawn_options(names: list[str]) -> st.SearchStrategy[list[str]]:
    """One to three of ``names``, each as ``--name=value`` with a bad value (the ``=`` hands
    values that start with ``-`` to the option)."""
    chosen = st.dictionaries(st.sampled_from(names), BAD_VALUES, min_size=1, max_size=3)
    return chosen.map(lambda options: [f"{name}={value}" for name, value in options.items()])


def assert_clean_end(proc: Ran) -> None:
    """Status 2 with one line on stderr, or success; no traceback either way (an exception
    that escaped the command would have failed the test already)."""
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode in (0, 2), (proc.returncode, proc.stderr)
    if proc.returncode == 2:
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory) -> Path:
    """A folder for mlx-lm's cache, kept empty, and a file named ``a-file``."""
    folder = tmp_path_factory.mktemp("fuzz")
    (folder / "a-file").write_text("")
    return folder


class Hung(BaseException):
    """A command ran past its time limit (a ``BaseException``, which no ``except Exception`` of
    the command takes for one of its errors)."""


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raises :class:`Hung` in the block once it has run ``seconds`` (a timer signal to this
    process, whose main thread runs the tests)."""

    def expire(signum, frame):
        raise Hung(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def fuzz_run(fuzz_dir: Path, *args: str) -> Ran:
    """``mlx_spec_main`` within 120 s, offline, so that a model name drawn as ``org/model`` is
    not fetched."""
    with offline(fuzz_dir), time_limit(120):
        return mlx_spec_main(*args)


PAIR_OPTIONS = [
    "--prompt",
    "--temp",
    "--top-p",
    "--top-k",
    "--min-p",
    "--num-draft-tokens",
    "--seed",
]
"""The options of ``generate`` drawn on the demo pair: all but the models and --max-tokens."""
GENERATE_OPTIONS = ["--model", "--draft-model", "--max-tokens", *PAIR_OPTIONS]


@settings(max_examples=30)
@given(options=drawn_options(GENERATE_OPTIONS))
def test_fuzz_generate_options(fuzz_dir, options):
    """The models are missing unless drawn: the run ends once the options are checked."""
    missing = "no-such-folder/"
    base = ["--model", missing, "--draft-model", missing, "--prompt", "x"]
    assert_clean_end(fuzz_run(fuzz_dir, "generate", *base, *options))


@settings(max_examples=15)
@given(
    options=drawn_options(
        ["--max-tokens", "--num-draft-tokens", "--fixed", "--repeats", "--seed", "--color"]
    )
)
def test_fuzz_demo_options(fuzz_dir, options):
    """Every value of the demo is checked by its parser; a word after the options that no
    option takes makes the parser refuse even good values, before the demo starts."""
    assert_clean_end(fuzz_run(fuzz_dir, "demo", *options, "stop-here"))


@settings(max_examples=15)
@given(value=BAD_VALUES)
def test_fuzz_bench_out(fuzz_dir, value):
    """--out is the value under a file, where no folder can be made (or empty, which the parser
    refuses): the run ends before measuring."""
    out = value and f"{fuzz_dir / 'a-file'}/{value}"
    assert_clean_end(fuzz_run(fuzz_dir, "bench", "--quick", f"--out={out}"))


@pytest.mark.slow
@settings(max_examples=25)
@given(options=drawn_options(PAIR_OPTIONS))
def test_fuzz_generate_options_on_the_demo_pair(fuzz_dir, options):
    """Values that pass the parser meet the models: the vocabulary, the sampler, the loop. At
    most three tokens (--max-tokens is not drawn), so that good values end soon too."""
    base = ["--model", TARGET, "--draft-model", DRAFT, "--prompt", "x", "--max-tokens", "3"]
    assert_clean_end(fuzz_run(fuzz_dir, "generate", *base, *options))


# -- --acceptance ------------------------------------------------------------------------------


@pytest.mark.parametrize("rule", ["coupled", "residual"])
def test_generate_samples_with_the_acceptance_rule_it_is_given(rule, monkeypatch):
    from mlx_spec import generation

    made = []

    def recorded(*args, **kwargs):
        made.append(kwargs.get("acceptance", args[1] if len(args) > 1 else None))
        return make_rule(*args, **kwargs)

    make_rule = generation.make_rule
    monkeypatch.setattr(generation, "make_rule", recorded)
    proc = generate("--temp", "1.0", "--max-tokens", "12", "--seed", "7", "--acceptance", rule)
    assert proc.returncode == 0, proc.stderr
    assert made == [rule] and SPECULATION.search(proc.stdout), proc.stdout
    # Residual text depends on the draft lengths: the seed reproduces it with --fixed alone.
    caveat = "(with residual acceptance, reproduces this text with --fixed only)"
    assert (caveat in proc.stdout) == (rule == "residual"), proc.stdout


def test_generate_offers_the_rules_the_library_has_and_refuses_others_in_one_line():
    from mlx_spec.cli.generate import setup_arg_parser
    from mlx_spec.rules import ACCEPTANCE

    option = next(a for a in setup_arg_parser()._actions if a.dest == "acceptance")
    assert tuple(option.choices) == tuple(ACCEPTANCE)
    proc = generate("--acceptance", "greedy")
    assert proc.returncode == 2 and proc.stdout == "" and proc.stderr.count("\n") == 1
    assert "--acceptance" in proc.stderr and "greedy" in proc.stderr
