"""Speculation on a target split over 2 processes of MLX's ring backend on the loopback.

How the ranks start: as ``mlx.launch -n 2 --backend ring --starting-port P`` starts them on the
host ``127.0.0.1`` (its default), each a local child with ``MLX_RANK`` and an ``MLX_HOSTFILE``
naming ``127.0.0.1:P`` and ``127.0.0.1:P+1``; the ring backend, which MLX's pip wheels include
on Linux and macOS, connects the two ranks over TCP there. So it needs only what CI installs with
pip, and ``P`` is a pair of ports found free, so that runs on one machine do not collide.
:func:`launch` starts the ranks of :mod:`distributed_worker` itself: ``mlx.launch`` forwards its
ranks' pipes in a loop that never blocks, which kept about half of one of the 2 cores busy for the
whole launch. The command's tests go through ``mlx.launch``, as its users do.

A launch reads what each rank wrote to its own file (``mlx.launch`` exits 0 even when a rank
fails): a missing file fails the test, with the launch's output. Every rank runs in its own
process group under a hard timeout, after which the groups are killed; a rank that dies or hangs
fails a test and never hangs the suite, and as ``mlx.launch`` does, a rank that exits with an
error stops the other. One launch runs every quick setting; the tests below read its results.

References come from this process: the same models built or loaded unsplit, mlx-lm's plain
``generate_step`` for greedy, and :func:`speculative_generate_step` with the same key for sampled.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from functools import cache
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from distributed_worker import (
    DRAFTERS,
    KEY_SEED,
    NO_KEY_SEED,
    QWEN2_FOLDER,
    SETTINGS,
    TEMP,
    TINY_PROMPT,
    generate,
    parameter_count,
    plain,
    save_qwen2,
)
from mlx_lm.generate import generate_step

from mlx_spec.distributed import agree_key, fresh_seed, load_sharded, model_group
from mlx_spec.sampling import make_sampler

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
WORKER = TESTS / "distributed_worker.py"
RANKS = 2
# Several times the quick launch's time on 2 cores shared with other heavy work; only a hung
# launch reaches it.
TIMEOUT_S = 240
# Seconds the other ranks get to end by themselves once one has failed.
GRACE_S = 5
QUICK = ("tensor", "pipeline", "hybrid")
# The one setting the quick suite launches: the tiny qwen2's pipeline, the fastest. The demo
# target's tensor split and the hybrid pipeline take most of the launch's time; --full runs them.
FIRST = "pipeline"
WORKING = [s if s == FIRST else pytest.param(s, marks=pytest.mark.slow) for s in QUICK]
KEYED = ("sampled", "no-key")


def free_ports(count: int) -> int:
    """The first of ``count`` consecutive loopback ports that are free now."""
    for _ in range(100):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            first = probe.getsockname()[1]
        sockets = []
        try:
            for port in range(first, first + count):
                s = socket.socket()
                sockets.append(s)
                s.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError(f"no {count} consecutive free ports on the loopback")


def mlx_launch() -> str:
    """``mlx.launch`` of the Python running the tests (its scripts folder first)."""
    found = shutil.which("mlx.launch", path=f"{Path(sys.executable).parent}{os.pathsep}")
    found = found or shutil.which("mlx.launch")
    if found is None:
        pytest.fail("mlx.launch not found: it comes with the mlx package")
    return found


def launch(*command: str, through_mlx_launch: bool = False) -> str:
    """Runs ``command`` on 2 ranks of the ring backend; returns their output (stdout and stderr
    together, rank by rank, or as ``mlx.launch`` forwarded it).

    Each rank (or ``mlx.launch``) runs in a process group of its own, killed after
    :data:`TIMEOUT_S` and at the end; a rank that exits with an error ends the others.
    """
    port = free_ports(RANKS)
    paths = [str(ROOT), os.environ.get("PYTHONPATH", "")]
    # Offline: loading the demo target with sharded_load must not reach the network.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, paths)), "HF_HUB_OFFLINE": "1"}
    with tempfile.TemporaryDirectory() as folder:
        if through_mlx_launch:
            launcher = [mlx_launch(), "-n", str(RANKS), "--backend", "ring"]
            runs = [([*launcher, "--starting-port", str(port), "--", *command], env)]
        else:
            hostfile = Path(folder) / "hosts.json"
            hostfile.write_text(json.dumps([[f"127.0.0.1:{port + r}"] for r in range(RANKS)]))
            rank_envs = [{"MLX_RANK": str(r), "MLX_HOSTFILE": str(hostfile)} for r in range(RANKS)]
            runs = [(list(command), {**env, **rank}) for rank in rank_envs]
        outputs = [Path(folder) / f"output{i}.txt" for i in range(len(runs))]
        processes = []
        try:
            for (run, run_env), output in zip(runs, outputs, strict=True):
                processes.append(start(run, run_env, output))
            timed_out = not wait_for_all(processes, TIMEOUT_S)
        finally:
            for process in processes:
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                process.wait()
        output = "".join(path.read_text() for path in outputs)
    if timed_out:
        pytest.fail(f"the launch ran over {TIMEOUT_S} s; its ranks were killed. Output:\n{output}")
    return output


def start(command: list[str], env: dict[str, str], output: Path) -> subprocess.Popen:
    """``command`` started in a process group of its own, writing to ``output``."""
    with output.open("w") as out:
        return subprocess.Popen(
            command,
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def wait_for_all(processes: list[subprocess.Popen], timeout: float) -> bool:
    """Waits until every process has exited; False if ``timeout`` seconds pass first. Once one
    has exited with an error, the others get :data:`GRACE_S` to end by themselves (a rank blocked
    on the ring never does)."""
    deadline = time.monotonic() + timeout
    failed = False
    while any(process.poll() is None for process in processes):
        if not failed and any(process.poll() for process in processes):
            failed = True
            deadline = min(deadline, time.monotonic() + GRACE_S)
        if time.monotonic() > deadline:
            return failed
        time.sleep(0.05)
    return True


def worker(out: Path, *settings: str) -> list[str]:
    """The command of a rank of :mod:`distributed_worker`, writing to ``out``."""
    return [sys.executable, str(WORKER), str(out), *settings]


def read_ranks(out: Path, setting: str, output: str) -> list[dict[str, Any]]:
    """Every rank's results for ``setting``; fails with the launch's output if one is missing."""
    results = []
    for rank in range(RANKS):
        path = out / f"{setting}-rank{rank}.json"
        if not path.exists():
            pytest.fail(f"rank {rank} wrote no results for {setting!r}. Launch output:\n{output}")
        results.append(json.loads(path.read_text()))
    return results


@pytest.fixture(scope="module")
def quick(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, str]:
    """One launch of every quick setting (with ``--full``; else of :data:`FIRST` alone): the
    folder of the ranks' results and the output."""
    out = tmp_path_factory.mktemp("ranks")
    save_qwen2(out / QWEN2_FOLDER)
    settings = QUICK if request.config.getoption("--full") else (FIRST,)
    return out, launch(*worker(out, *settings))


def ranks(quick: tuple[Path, str], setting: str) -> list[dict[str, Any]]:
    return read_ranks(quick[0], setting, quick[1])


def case(quick: tuple[Path, str], setting: str, name: str) -> list[list[int]]:
    """Every rank's tokens for one case; fails with the error a rank raised instead."""
    tokens = []
    for rank, results in enumerate(ranks(quick, setting)):
        result = results["cases"][name]
        assert "tokens" in result, f"rank {rank}, {setting} {name}: {result['error']}"
        tokens.append(result["tokens"])
    return tokens


@cache
def whole(setting: str) -> dict[str, Any]:
    """The setting's models in this one process, the target unsplit."""
    return SETTINGS[setting](None, None)


@cache
def reference(setting: str, name: str, drafter: str) -> list[int]:
    """What one process gives for a case: plain decoding for greedy, else speculation."""
    models = whole(setting)
    if name == "greedy":
        return plain(models)
    sampler = make_sampler(temp=TEMP)
    if name == "no-key":
        # Rank 0 was seeded so; the group agreed on its draw.
        mx.random.seed(NO_KEY_SEED)
        return generate(models, drafter, sampler=sampler)
    return generate(models, drafter, sampler=sampler, key=mx.random.key(KEY_SEED))


# --- the group and the split -------------------------------------------------------------------


@pytest.mark.parametrize("setting", WORKING)
def test_model_group_is_the_targets_not_the_drafts(quick, setting) -> None:
    for results in ranks(quick, setting):
        assert results["size"] == RANKS
        assert results["model_group_size"] == RANKS
        assert not results["draft_group"]


@pytest.mark.parametrize("setting", WORKING)
def test_each_rank_holds_part_of_the_target(quick, setting) -> None:
    unsplit = parameter_count(whole(setting)["target"])
    for results in ranks(quick, setting):
        assert results["parameters"] < unsplit


def test_fresh_seed_is_the_same_on_every_rank(quick) -> None:
    seeds = {results["fresh_seed"] for results in ranks(quick, FIRST)}
    assert len(seeds) == 1


# --- generation on the split target ------------------------------------------------------------


@pytest.mark.parametrize("drafter", DRAFTERS)
@pytest.mark.parametrize("setting", WORKING)
def test_greedy_equals_plain_decoding_of_the_whole_target(quick, setting, drafter) -> None:
    expected = reference(setting, "greedy", drafter)
    assert len(set(expected)) > len(expected) // 4  # varied text, so the comparison means something
    for tokens in case(quick, setting, f"greedy/{drafter}"):
        assert tokens == expected


@pytest.mark.parametrize("setting", WORKING)
def test_plain_decoding_of_the_split_target_equals_the_whole(quick, setting) -> None:
    for tokens in case(quick, setting, "plain"):
        assert tokens == reference(setting, "greedy", "model")


@pytest.mark.parametrize("drafter", DRAFTERS)
@pytest.mark.parametrize("setting", WORKING)
def test_sampled_with_a_key_equals_one_process(quick, setting, drafter) -> None:
    expected = reference(setting, "sampled", drafter)
    assert expected != reference(setting, "greedy", drafter)
    for tokens in case(quick, setting, f"sampled/{drafter}"):
        assert tokens == expected


@pytest.mark.parametrize("drafter", DRAFTERS)
@pytest.mark.parametrize("setting", WORKING)
def test_no_key_takes_rank_0s_draw_on_every_rank(quick, setting, drafter) -> None:
    # The ranks' global random states differ (seeded with rank), so agreeing needs the group.
    for tokens in case(quick, setting, f"no-key/{drafter}"):
        assert tokens == reference(setting, "no-key", drafter)
    assert reference(setting, "no-key", drafter) != reference(setting, "sampled", drafter)


@pytest.mark.parametrize("name", ["keys-differ", "key-on-rank-0-only"])
@pytest.mark.parametrize("setting", WORKING)
def test_keys_that_differ_raise_on_every_rank(quick, setting, name) -> None:
    # The generations after these calls (above) show that the ranks stayed in step.
    for rank, results in enumerate(ranks(quick, setting)):
        error = results["cases"][name].get("error", "")
        assert "speculative_generate_step: `key` differs between the 2 ranks" in error, rank


# Each case of distributed_worker.differing: what the error shows of the argument that differs.
DIFFERING = {
    "max_tokens": "`max_tokens`: rank 0: 10, rank 1: 24",
    "num_draft_tokens": "`num_draft_tokens`: rank 0: 3, rank 1: 5",
    "drafter": "the drafter (`draft_model` or `drafter`): rank 0: a draft model, rank 1: prompt "
    "lookup (max_ngram 3",
    "prompt": "`prompt`: rank 0: {0} tokens (crc32 ",
    "policy": "the draft-length policy (`adaptive` or `policy`): rank 0: fixed, rank 1: adaptive",
    "acceptance": "the acceptance rule (`sampler` and `acceptance`): rank 0: greedy, rank 1: "
    "coupled",
}


@pytest.mark.parametrize("name", DIFFERING)
@pytest.mark.parametrize("setting", WORKING)
def test_arguments_that_shape_a_round_and_differ_raise_on_every_rank(quick, setting, name) -> None:
    # The generations after these calls (above) show that the ranks stayed in step.
    errors = [
        results["cases"][f"differ/{name}"].get("error", "") for results in ranks(quick, setting)
    ]
    assert errors[0] == errors[1], errors
    assert errors[0].startswith(
        "speculative_generate_step: the 2 ranks of the distributed group the model runs on were "
        "given different arguments"
    ), errors[0]
    length = len(whole(setting)["prompt"])
    assert DIFFERING[name].format(length) in errors[0], errors[0]
    if name == "prompt":
        assert f"rank 1: {length + 1} tokens" in errors[0], errors[0]
    # Only the argument that differs is named.
    assert errors[0].count("rank 0: ") == 1, errors[0]


# --- what ends a launch ------------------------------------------------------------------------


@pytest.mark.slow
def test_an_uncaught_key_error_ends_every_rank(tmp_path) -> None:
    launch(*worker(tmp_path, "uncaught"))
    for rank in range(RANKS):
        error = (tmp_path / f"uncaught-rank{rank}.txt").read_text()
        assert error.startswith("speculative_generate_step: `key` differs between the 2 ranks")
    assert not list(tmp_path.glob("*finished*"))


@pytest.mark.slow
def test_a_rank_that_dies_ends_the_launch(tmp_path) -> None:
    launch(*worker(tmp_path, "die"))
    assert (tmp_path / "die-rank1.txt").exists()
    assert not list(tmp_path.glob("*finished*"))


# --- one process ------------------------------------------------------------------------------


def test_one_process_has_no_group() -> None:
    models = whole("pipeline")
    assert model_group(models["target"], models["draft"]) is None
    assert model_group(models["target"], group=mx.distributed.init()) is None


def test_adaptive_lookup_on_a_group_chooses_and_learns_by_label(monkeypatch) -> None:
    # On a group (here one of size 1, given as the models' group), each round's outcome is told a
    # round late, with rank 0's time, and there are no stretches; prompt lookup is still asked
    # first, and each round's choice and outcome carry its proposal's label (the matched
    # n-gram's length, >= 1).
    from mlx_spec import generation as generation_module
    from mlx_spec.draft_length import Adaptive

    monkeypatch.setattr(generation_module, "model_group", lambda *_: mx.distributed.init())
    chosen, told = [], []
    choose, observe = Adaptive.choose, Adaptive.observe

    def spy_choose(self, round):
        chosen.append(round.label)
        return choose(self, round)

    def spy_observe(self, outcome):
        told.append(outcome)
        return observe(self, outcome)

    monkeypatch.setattr(Adaptive, "choose", spy_choose)
    monkeypatch.setattr(Adaptive, "observe", spy_observe)
    models = whole("pipeline")
    prompt = mx.array(TINY_PROMPT * 6)
    stats = generation_module.SpeculativeStats()
    steps = generation_module.speculative_generate_step(
        prompt, models["target"], drafter="prompt-lookup", adaptive=True, max_tokens=60,
        stats=stats,
    )  # fmt: skip
    tokens = [token for token, _, _ in steps]
    assert tokens == [t for t, _ in generate_step(prompt, models["target"], max_tokens=60)]
    drafted = [o.label for o in told if o.drafted]
    assert len(drafted) >= 3 and min(chosen) >= 1 and min(drafted) >= 1
    # Every round but the last was told, each with a time; no plain step ran.
    assert len(told) == stats.rounds - 1 and all(o.seconds is not None for o in told)
    assert not any(o.plain and o.first for o in told)


def test_agree_key_without_a_group_keeps_the_callers_key() -> None:
    key = mx.random.key(5)
    assert agree_key("op", key, None).tolist() == key.tolist()


def test_agree_key_without_a_group_takes_mx_randoms_state() -> None:
    # The state the text positions' keys start from, so that mx.random.seed gives mlx-lm's text.
    mx.random.seed(3)
    assert agree_key("op", None, None).tolist() == mx.random.key(3).tolist()


def test_agree_key_rejects_a_malformed_key() -> None:
    with pytest.raises(ValueError, match=r"^op: `key` must be a \[2\] uint32 key"):
        agree_key("op", mx.array([1, 2, 3], dtype=mx.uint32), None)


def test_fresh_seed_in_one_process() -> None:
    assert 0 <= fresh_seed(None) < 2**32


def test_load_sharded_on_a_group_of_one_loads_the_whole_model() -> None:
    model, tokenizer = load_sharded(ROOT / "mlx_spec" / "demo" / "target", mx.distributed.init())
    assert model_group(model) is None
    assert parameter_count(model) == parameter_count(whole("tensor")["target"])
    assert tokenizer.encode("def")


# --- the command --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "drafts",
    [["--prompt-lookup"], pytest.param(["--draft-model", "DRAFT"], marks=pytest.mark.slow)],
)
def test_the_command_splits_the_target_and_only_rank_0_prints(drafts) -> None:
    demo = ROOT / "mlx_spec" / "demo"
    drafts = [str(demo / "draft") if d == "DRAFT" else d for d in drafts]
    prompt = "def area(r):\n    return 3.14 * r * r\n\ndef area(r):\n"
    output = launch(
        sys.executable, "-m", "mlx_spec", "generate", "--model", str(demo / "target"), *drafts,
        "--prompt", prompt, "--temp", "0.8", "--max-tokens", "24", "--ignore-chat-template",
        through_mlx_launch=True,
    )  # fmt: skip
    # One summary: rank 1 printed nothing, and no rank failed.
    assert output.count("Speculation: ") == 1, output
    assert output.count("==========") == 1 and "Traceback" not in output, output
    # No --seed: the ranks agreed on rank 0's fresh seed (else the key check would have failed).
    assert "seed " in output.split("Speculation: ")[1]
