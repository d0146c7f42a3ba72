"""A key or a seed gives the same text: whatever the drafter, N, adaptive choices, timing or
``max_tokens``, and the text of mlx-lm's own plain sampling under the same seed.

Coupled sampling draws the token at each text position with that position's random state
(:mod:`mlx_spec.keys`), exactly as mlx-lm's sampler draws it at that step, so the comparison is
token for token. The logits of a verification and of a one-token step may differ in rounding; a
token could then differ where two candidates tie within that rounding. The equality tests count
such differences over hundreds of tokens and find none.
"""

from __future__ import annotations

import subprocess
import sys
import time
from contextlib import contextmanager
from functools import cache

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from helpers import PROMPT, ByteTokenizer, Silent, run
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler as lm_make_sampler

from mlx_spec import cli, keys
from mlx_spec._demo import DEMO_DIR, GROUNDED, PROMPTS
from mlx_spec.draft_length import Adaptive, Calibration, Fixed
from mlx_spec.generation import speculative_generate_step
from mlx_spec.patch import patch_mlx_lm, unpatch_mlx_lm
from mlx_spec.sampling import make_sampler

SAMPLERS = {
    "t0.9": dict(temp=0.9),
    "t1 top-p": dict(temp=1.0, top_p=0.9),
    "t0.7 min-p": dict(temp=0.7, min_p=0.05),
}


def sampled(model, draft=None, *, seed: int | None = None, **kwargs) -> list[int]:
    """The tokens of one generation; ``seed`` seeds ``mx.random`` first (else ``key`` must be
    given)."""
    if seed is not None:
        mx.random.seed(seed)
    tokens, _, _ = run(PROMPT, model, draft, **kwargs)
    return tokens


def plain_mlx_lm(model, prompt, seed: int, max_tokens: int, **sampler) -> list[int]:
    """mlx-lm's own plain sampling after ``mx.random.seed(seed)``."""
    mx.random.seed(seed)
    steps = generate_step(
        mx.array(prompt), model, max_tokens=max_tokens, sampler=lm_make_sampler(**sampler)
    )
    return [t for t, _ in steps]


@contextmanager
def busy_cpu():
    """A process burning a core beside the test, as a loaded machine runs."""
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.2)
        yield
    finally:
        burner.kill()
        burner.wait()


@pytest.mark.parametrize("steps", [1, 2])
def test_the_key_chain_is_mx_randoms_sequence(steps) -> None:
    # Position t's state is the state mx.random's sequence reaches after t draws of `steps` keys
    # each, and its key the one it hands out there, read in pieces out of order, across the
    # host arrays' growth.
    start = mx.random.key(7)
    expected, state = [], start
    for _ in range(150):
        expected.append(state.tolist())
        for _ in range(steps):
            state = mx.random.split(state)[0]
    chain = keys.KeyChain(start, steps)
    pieces = [(0, 1), (1, 40), (100, 50), (41, 59)]
    got = {first: chain.states(first, count).tolist() for first, count in pieces}
    assert [row for first, _ in sorted(pieces) for row in got[first]] == expected
    assert chain.state(63).tolist() == expected[63]
    # Each position's key: the one mx.random.categorical takes from the sequence at its state.
    drawn = [mx.random.split(mx.array(s, dtype=mx.uint32))[1].tolist() for s in expected]
    got = {first: chain.keys(first, count).tolist() for first, count in pieces}
    assert [row for first, _ in sorted(pieces) for row in got[first]] == drawn
    # No positions, where a block ends and one not yet computed begins.
    assert chain.keys(160, 0).shape == (0, 2) and chain.states(160, 0).shape == (0, 2)


def test_the_hosts_split_is_mlxs() -> None:
    # The chain's Threefry on the host must give MLX's bits, word for word, for any key.
    # The two lanes of the host's words must not carry into each other: the largest words too.
    rng = np.random.default_rng(0)
    edges = [[0, 0], [2**32 - 1, 2**32 - 1], [2**32 - 1, 0], [0, 2**32 - 1]]
    for k0, k1 in edges + rng.integers(0, 2**32, size=(300, 2), dtype=np.uint64).tolist():
        split = mx.random.split(mx.array([k0, k1], dtype=mx.uint32)).reshape(-1).tolist()
        assert keys._host_split(k0, k1) == tuple(split)
    assert keys._split() is keys._host_split


def test_a_host_split_that_disagrees_with_mlx_is_not_used(monkeypatch) -> None:
    # A later MLX could make its bits otherwise: the chain then splits with MLX, and stays its
    # sequence.
    monkeypatch.setattr(keys, "_host_split", lambda k0, k1: (k0, k1, k1, k0))
    monkeypatch.setattr(keys, "_split", cache(keys._split.__wrapped__))
    assert keys._split() is keys._device_split
    start = mx.random.key(3)
    state, expected = start, []
    for _ in range(5):
        state, key = mx.random.split(state)
        expected.append(key.tolist())
    assert keys.KeyChain(start).keys(0, 5).tolist() == expected


@pytest.mark.parametrize("name", list(SAMPLERS))
def test_the_text_is_the_same_whatever_the_drafter_and_n(target, drafts, name) -> None:
    options = dict(sampler=make_sampler(**SAMPLERS[name]), key=mx.random.key(4), max_tokens=80)
    reference = sampled(target, None, drafter=Silent(), **options)
    ways = [
        dict(draft=drafts["truncated"], num_draft_tokens=1),
        dict(draft=drafts["truncated"], num_draft_tokens=5),
        dict(draft=drafts["unrelated"], num_draft_tokens=3),
        dict(draft=drafts["self"], num_draft_tokens=4),
        dict(drafter="prompt-lookup", num_draft_tokens=2),
        dict(drafter="prompt-lookup", num_draft_tokens=6, adaptive=True),
        dict(draft=drafts["truncated"], policy=Adaptive(6, Calibration(1.0, 1.1, 0.05))),
    ]
    for way in ways:
        draft = way.pop("draft", None)
        assert sampled(target, draft, **way, **options) == reference, way


def test_the_residual_rule_is_reproducible_for_the_same_lengths(target, drafts) -> None:
    options = dict(
        sampler=make_sampler(temp=1.0), key=mx.random.key(2), max_tokens=60, acceptance="residual"
    )
    a = sampled(target, drafts["truncated"], num_draft_tokens=3, **options)
    b = sampled(target, drafts["truncated"], num_draft_tokens=3, **options)
    c = sampled(target, drafts["truncated"], num_draft_tokens=3, **{**options, "key": None})
    assert a == b != c


@pytest.mark.parametrize("way", ["draft model", "prompt lookup, adaptive"])
def test_a_shorter_max_tokens_gives_a_prefix(target, drafts, way) -> None:
    draft = drafts["truncated"] if way == "draft model" else None
    kwargs = {} if draft is not None else dict(drafter="prompt-lookup", adaptive=True)
    options = dict(sampler=make_sampler(temp=0.9), key=mx.random.key(8), num_draft_tokens=4)
    long = sampled(target, draft, max_tokens=200, **options, **kwargs)
    short = sampled(target, draft, max_tokens=100, **options, **kwargs)
    assert len(long) == 200 and short == long[:100]


def test_adaptive_lengths_on_a_busy_machine_give_the_same_text(target, drafts) -> None:
    # Adaptive lengths measure what rounds cost: a core burning beside the generation changes
    # the measurement, so the rounds fall differently, but not the text.
    options = dict(sampler=make_sampler(temp=0.8), key=mx.random.key(6), max_tokens=150)
    quiet = run(PROMPT, target, drafts["truncated"], policy=Adaptive(6), **options)
    with busy_cpu():
        busy = run(PROMPT, target, drafts["truncated"], policy=Adaptive(6), **options)
    fixed = run(PROMPT, target, drafts["truncated"], policy=Fixed(2), **options)
    assert quiet[0] == busy[0] == fixed[0]


@pytest.mark.parametrize("name", list(SAMPLERS))
def test_a_seed_gives_the_text_of_mlx_lms_plain_sampling(target, drafts, name) -> None:
    reference = plain_mlx_lm(target, PROMPT, 5, 120, **SAMPLERS[name])
    sampler = make_sampler(**SAMPLERS[name])
    for draft, kwargs in [
        (None, dict(drafter=Silent())),
        (drafts["truncated"], dict(num_draft_tokens=3)),
        (None, dict(drafter="prompt-lookup", adaptive=True)),
    ]:
        tokens = sampled(target, draft, seed=5, sampler=sampler, max_tokens=120, **kwargs)
        assert tokens == reference, kwargs


def test_mlx_lms_own_samplers_give_its_text_too(target, drafts) -> None:
    # mlx-lm's samplers expose no distribution; each position calls them with its state, also
    # XTC's, which draws two keys a token. Its top-k refuses a k not below the row's width: the
    # rule's probe of how many keys a call draws must not trip on it.
    for sampler in (
        dict(temp=0.8),
        dict(temp=0.8, xtc_probability=0.5, xtc_threshold=0.05),
        dict(temp=0.8, top_k=8, xtc_probability=0.5, xtc_threshold=0.05),
    ):
        reference = plain_mlx_lm(target, PROMPT, 9, 80, **sampler)
        tokens = sampled(
            target, drafts["truncated"], seed=9, sampler=lm_make_sampler(**sampler), max_tokens=80
        )
        assert tokens == reference, sampler


def test_a_key_is_the_seed_it_was_made_from_and_leaves_mx_random_alone(target, drafts) -> None:
    reference = plain_mlx_lm(target, PROMPT, 12, 60, temp=0.9)
    mx.random.seed(100)
    before = mx.random.state[0].tolist()
    tokens = sampled(
        target, drafts["truncated"], key=mx.random.key(12), sampler=make_sampler(temp=0.9),
        max_tokens=60,
    )  # fmt: skip
    assert tokens == reference
    assert mx.random.state[0].tolist() == before


def test_consecutive_seeded_generations_follow_mlx_lms(target, drafts) -> None:
    # Without a key, the generation advances mx.random's state as mlx-lm's loop does: the next
    # generation continues from where mlx-lm's would.
    mx.random.seed(21)
    sampler = lm_make_sampler(temp=0.9)
    references = [
        [t for t, _ in generate_step(mx.array(PROMPT), target, max_tokens=30, sampler=sampler)]
        for _ in range(2)
    ]
    mx.random.seed(21)
    ours = [sampled(target, drafts["truncated"], sampler=make_sampler(temp=0.9), max_tokens=30)]
    ours.append(sampled(target, None, drafter="prompt-lookup", sampler=make_sampler(temp=0.9),
                        max_tokens=30))  # fmt: skip
    assert ours == references and references[0] != references[1]


def test_the_patched_mlx_lm_command_prints_the_unpatched_plain_text(
    target, monkeypatch, capsys
) -> None:
    # `mlx_lm.generate --seed 3 --temp 0.9`: plain, unpatched; then patched with a draft model.
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    class Tok(ByteTokenizer):
        vocab_size = 256

    tokenizer = TokenizerWrapper(Tok())

    def load(path, **kwargs):
        return (target, tokenizer, {}) if kwargs.get("return_config") else (target, tokenizer)

    import importlib

    lm_generate = importlib.import_module("mlx_lm.generate")
    monkeypatch.setattr(lm_generate, "load", load)
    argv = "mlx_lm.generate --model m --temp 0.9 --max-tokens 60 --seed 3"
    argv += " --ignore-chat-template --prompt hello"

    def text(extra: str) -> str:
        monkeypatch.setattr(sys, "argv", (argv + extra).split())
        lm_generate.main()
        return capsys.readouterr().out.split("==========")[1]

    plain = text("")
    patch_mlx_lm()
    try:
        speculative = text(" --draft-model d --num-draft-tokens 3")
    finally:
        unpatch_mlx_lm()
    assert speculative == plain and plain.strip()


@pytest.fixture(scope="module")
def demo():
    target, tokenizer = mlx_lm.load(str(DEMO_DIR / "target"))
    draft, _ = mlx_lm.load(str(DEMO_DIR / "draft"))
    return target, draft, tokenizer


@pytest.mark.slow
@pytest.mark.parametrize(("name", "prompt"), [("t0.9", PROMPTS[0]), ("t1 top-p", GROUNDED[0])])
def test_the_demo_pair_gives_mlx_lms_seeded_text_over_hundreds_of_tokens(demo, name, prompt):
    # bfloat16 logits, 300 tokens, three ways to draft: every token equal.
    target, draft, tokenizer = demo
    sampler = make_sampler(**SAMPLERS[name])
    ids = tokenizer.encode(prompt)
    reference = plain_mlx_lm(target, ids, 1, 300, **SAMPLERS[name])
    differing = []
    for model, kwargs in [
        (draft, dict(num_draft_tokens=3)),
        (draft, dict(adaptive=True, num_draft_tokens=6)),
        (None, dict(drafter="prompt-lookup", adaptive=True)),
    ]:
        mx.random.seed(1)
        steps = speculative_generate_step(
            mx.array(ids), target, model, sampler=sampler, max_tokens=300, **kwargs
        )
        tokens = [t for t, _, _ in steps]
        differing += [sum(a != b for a, b in zip(tokens, reference, strict=True))]
    assert differing == [0, 0, 0]


def generated_text(capsys, argv: list[str]) -> str:
    """The text ``mlx-spec generate`` printed (before its counts), run in-process."""
    assert cli.main(argv) == 0
    return capsys.readouterr().out.split("==========")[0]


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory) -> tuple[str, str]:
    """Model folders of a tiny llama and its first layer, with the demo's tokenizer."""
    from tiny_models import cut, save_model_folder, tiny_llama

    root = tmp_path_factory.mktemp("tiny")
    model = tiny_llama(0, vocab=4096)
    for name, weights in (("target", model), ("draft", cut(model, 1))):
        weights.args.max_position_embeddings = 4096  # mlx-lm's loader asks for it
        save_model_folder(weights, root / name, tokenizer_from=DEMO_DIR / "target")
    return str(root / "target"), str(root / "draft")


def test_the_commands_seed_reproduces_its_text_with_its_defaults(capsys, tiny_folders) -> None:
    # `mlx-spec generate --temp 0.8 --seed 3`: adaptive lengths by default; again on a busy
    # machine, and with a fixed length: the same text each time. The command's options are the
    # point, not the model: a tiny llama with the demo's tokenizer.
    target, draft = tiny_folders
    command = ["generate", "--model", target, "--prompt", "def read_file(path):"]
    command += ["--ignore-chat-template", "-m", "64", "--temp", "0.8", "--seed", "3"]
    argv = [*command, "--draft-model", draft]
    first = generated_text(capsys, argv)
    with busy_cpu():
        busy = generated_text(capsys, argv)
    fixed = generated_text(capsys, [*argv, "--fixed", "-n", "3"])
    lookup = generated_text(capsys, [*command, "--prompt-lookup"])
    assert first == busy == fixed == lookup and first.strip()
