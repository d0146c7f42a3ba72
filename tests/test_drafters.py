"""Drafters: prompt lookup (its index, its proposals, lossless generation at any temperature),
the model drafter through the same interface, and the choice of the draft length."""

from __future__ import annotations

import gc
import importlib
import itertools
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from first_tokens import THRESHOLD, chi_square_p, exact_joint, sampled_pairs
from helpers import PROMPT, run
from mlx_lm import load
from mlx_lm.generate import generate_step
from tiny_models import tiny_llama

import mlx_spec
from mlx_spec import drafters, loop, rules
from mlx_spec.acceptance import accept_sampled
from mlx_spec.draft_length import DraftLength
from mlx_spec.drafters import Draft, Drafter, DraftSetup, PromptLookupDrafter, Text
from mlx_spec.generation import SpeculativeStats, speculative_generate_step
from mlx_spec.patch import patch_mlx_lm, unpatch_mlx_lm
from mlx_spec.rules import Rule
from mlx_spec.sampling import make_sampler

lm_generate = importlib.import_module("mlx_lm.generate")


def lookup(ids: list[int], n: int, **options) -> list[int]:
    """What a fresh lookup drafter proposes after ``ids``."""
    drafter = PromptLookupDrafter(**options)
    text = Text(mx.array(ids, dtype=mx.uint32), list(ids))
    drafter.start(text, DraftSetup(Rule("greedy")))
    return drafter.propose(text, n, None).tokens.tolist()


# --- the lookup index and its proposals ----------------------------------------------------------


def test_lookup_proposes_what_followed_the_latest_match() -> None:
    # (7, 8) occurs twice before the end; the latest occurrence was followed by 5, 6.
    assert lookup([7, 8, 1, 2, 9, 7, 8, 5, 6, 0, 7, 8], 2) == [5, 6]


def test_lookup_prefers_the_longest_ngram() -> None:
    # The 3-gram (1, 7, 8) matches the first occurrence; the 2-gram alone would match the second.
    ids = [1, 7, 8, 4, 4, 2, 7, 8, 5, 5, 1, 7, 8]
    assert lookup(ids, 2, max_ngram=3) == [4, 4]
    assert lookup(ids, 2, max_ngram=2) == [5, 5]


def test_lookup_falls_back_to_shorter_ngrams_down_to_min() -> None:
    ids = [3, 9, 4, 5, 6, 9]
    assert lookup(ids, 3, max_ngram=3, min_ngram=1) == [4, 5, 6]
    assert lookup(ids, 3, max_ngram=3, min_ngram=2) == []


def test_lookup_never_proposes_past_the_end_of_the_text() -> None:
    assert lookup([5, 6, 7, 5], 8, max_ngram=1) == [6, 7, 5]


def test_lookup_proposes_nothing_for_zero_tokens_or_no_match() -> None:
    assert lookup([1, 2, 3], 0) == []
    assert lookup([1, 2, 3], 4) == []


def test_lookup_index_grows_with_the_tokens_added() -> None:
    drafter = PromptLookupDrafter(max_ngram=3, min_ngram=1)
    prompt = np.random.default_rng(0).integers(0, 50_000, size=100_000).tolist()
    text = Text(mx.array(prompt[:8], dtype=mx.uint32), prompt[:8])
    drafter.start(text, DraftSetup(Rule("greedy")))
    text.extend(prompt[8:])
    drafter.update(text, 0)
    writes = []

    class Counting(dict):
        def __setitem__(self, key, value):
            writes.append(key)
            super().__setitem__(key, value)

    index = drafter._index
    index.last = Counting(index.last)
    text.extend([11, 12, 13, 14])
    drafter.update(text, 0)
    # Four tokens, three n-gram sizes each: twelve writes, whatever the text's length.
    assert len(writes) == 12
    assert len(index.ids) == 100_004
    # A proposal tries each n-gram size at most once.
    looked = []

    class Looking(dict):
        def __contains__(self, key):
            looked.append(key)
            return super().__contains__(key)

    index.last = Looking(index.last)
    drafter.propose(text, 8, None)
    assert 1 <= len(looked) <= 3


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"max_ngram": 0}, "`max_ngram`"),
        ({"min_ngram": -1}, "`min_ngram`"),
        ({"max_ngram": 2.0}, "`max_ngram`"),
        ({"max_ngram": True}, "`max_ngram`"),
        ({"max_ngram": 2, "min_ngram": 3}, "`min_ngram`"),
        ({"distribution": "yes"}, "`distribution`"),
    ],
)
def test_lookup_arguments_are_checked(options, match) -> None:
    with pytest.raises(ValueError, match=rf"PromptLookupDrafter: {match}"):
        PromptLookupDrafter(**options)


def test_distribution_mode_draws_from_the_continuation_frequencies() -> None:
    # (1, 2) was followed by 3 twice and 5 once: q = {3: 2/3, 5: 1/3}.
    ids = [1, 2, 3, 1, 2, 5, 1, 2, 3, 9, 1, 2]
    drafter = PromptLookupDrafter(max_ngram=2, min_ngram=2, distribution=True)
    text = Text(mx.array(ids, dtype=mx.uint32), ids)
    drafter.start(text, DraftSetup(Rule("sampled", make_sampler(temp=1.0)), seed=5))
    firsts = []
    for _ in range(600):
        draft = drafter.propose(text, 1, None)
        q = np.array(draft.probs)[0]
        np.testing.assert_allclose(q[[3, 5]], [2 / 3, 1 / 3], rtol=1e-6)
        assert q.sum() == pytest.approx(1.0) and np.count_nonzero(q) == 2
        firsts.append(draft.tokens.item())
    share = firsts.count(3) / len(firsts)
    # 600 draws of a 2/3 coin: 5 standard deviations is 0.096.
    assert abs(share - 2 / 3) < 0.096 and set(firsts) == {3, 5}


# --- lossless at temperature 0 -------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo():
    folder = Path(mlx_spec.__file__).parent / "demo"
    model, tokenizer = load(str(folder / "target"))
    return model, tokenizer


def test_lookup_greedy_equals_plain_on_the_demo_target_copying_code(demo) -> None:
    # Input-grounded: the prompt holds code that the output repeats, so lookups keep matching.
    model, tokenizer = demo
    code = "def read_file(path):\n    with open(path) as f:\n        return f.read()\n\n"
    prompt = mx.array(tokenizer.encode(code * 3 + "def read_file(path):\n"))
    plain = [t for t, _ in generate_step(prompt, model, max_tokens=300)]
    for n in (1, 3, 8):
        stats = SpeculativeStats()
        steps = speculative_generate_step(
            prompt, model, drafter="prompt-lookup", num_draft_tokens=n, max_tokens=300, stats=stats
        )
        assert [t for t, _, _ in steps] == plain
        assert stats.tokens_per_round > 1.3


@pytest.mark.parametrize("n", [1, 3, 8])
def test_lookup_greedy_equals_plain_on_a_tiny_model(target, greedy_reference, n) -> None:
    tokens, _, stats = run(PROMPT, target, None, drafter="prompt-lookup", num_draft_tokens=n)
    assert tokens == greedy_reference[:256]
    assert 0 < stats.drafted and stats.accepted < stats.drafted


def test_lookup_that_never_matches_is_plain_decoding(target, greedy_reference) -> None:
    never = PromptLookupDrafter(max_ngram=12, min_ngram=12)
    tokens, _, stats = run(PROMPT, target, None, drafter=never, max_tokens=300)
    assert tokens == greedy_reference
    assert stats.drafted == 0 and stats.rounds == 300


class Silent(Drafter):
    """Never proposes anything (a lookup that never matches)."""

    free = True

    def propose(self, text, n, key) -> Draft:
        return Draft(mx.array([], dtype=mx.uint32))


@pytest.mark.parametrize("temp", [0.0, 1.0])
def test_stretches_of_plain_steps_give_the_tokens_of_rounds_without_drafts(
    target, temp, monkeypatch
) -> None:
    # Adaptive lengths run what drafting nothing costs as stretches of pipelined plain steps;
    # each step draws with the keys of a round without drafts, so the text is the same.
    sampler = make_sampler(temp=temp)
    options = dict(sampler=sampler, key=mx.random.key(9), max_tokens=150, num_draft_tokens=4)
    rounds, _, fixed = run(PROMPT, target, None, drafter=Silent(), **options)
    stretched, flags, adaptive = run(
        PROMPT, target, None, drafter=Silent(), adaptive=True, **options
    )
    assert stretched == rounds and not any(flags)
    # One target call a token either way.
    assert fixed.rounds == adaptive.rounds == 150 and adaptive.drafted == 0


def test_an_invalid_row_in_a_stretch_raises(target) -> None:
    # A stretch's plain steps check their rows as rounds do: a NaN row raises, naming it.
    def nan_after_five(tokens: mx.array, logits: mx.array) -> mx.array:
        return logits * mx.nan if tokens.size >= len(PROMPT) + 5 else logits

    with pytest.raises(ValueError, match=r"^speculative_generate_step: .* at position 0 decided"):
        run(PROMPT, target, None, drafter=Silent(), adaptive=True, max_tokens=20,
            logits_processors=[nan_after_five])  # fmt: skip


def test_a_stretch_stopped_early_leaves_the_prompt_and_yielded_tokens(
    target, greedy_reference
) -> None:
    # Closed mid-stretch, and stopped by an EOS mid-stretch: the step built ahead of the read
    # is taken back, and the caches continue plain decoding's text.
    from mlx_lm.models.cache import make_prompt_cache

    for stop in ("close", "eos"):
        cache = make_prompt_cache(target)
        eos = [greedy_reference[41]] if stop == "eos" else None
        steps = speculative_generate_step(
            mx.array(PROMPT), target, drafter=Silent(), adaptive=True, prompt_cache=cache,
            max_tokens=300, eos_token_ids=eos,
        )  # fmt: skip
        tokens = [t for t, _, _ in itertools.islice(steps, 37 if stop == "close" else 300)]
        steps.close()
        assert tokens == greedy_reference[: len(tokens)]
        assert {c.offset for c in cache} == {len(PROMPT) + len(tokens)}
        more, _, _ = run([greedy_reference[len(tokens)]], target, None, drafter=Silent(),
                         prompt_cache=cache, max_tokens=5)  # fmt: skip
        assert more == greedy_reference[len(tokens) + 1 : len(tokens) + 6]


@pytest.mark.parametrize("drafter", ["prompt-lookup", "model"])
def test_adaptive_length_stays_lossless(target, drafts, greedy_reference, drafter) -> None:
    kwargs = {"drafter": drafter} if drafter != "model" else {}
    draft = drafts["truncated"] if drafter == "model" else None
    tokens, _, stats = run(
        PROMPT, target, draft, num_draft_tokens=8, adaptive=True, max_tokens=300, **kwargs
    )
    assert tokens == greedy_reference
    assert stats.rounds < 300 or drafter == "prompt-lookup"


# --- lossless when sampling ----------------------------------------------------------------------

SMALL_VOCAB = 24


@pytest.fixture(scope="module")
def small():
    return tiny_llama(3, vocab=SMALL_VOCAB, head=4.0)


@pytest.fixture(scope="module")
def copied(small) -> list[int]:
    """A prompt that repeats the model's own greedy text: each lookup proposes the token the
    model favours there (a single continuation), so a wrong rule moves much probability."""
    text = [1, 2, 3] + [t for t, _ in generate_step(mx.array([1, 2, 3]), small, max_tokens=12)]
    return text + text[:6]


@pytest.fixture(scope="module")
def branching(small, copied) -> list[int]:
    """``copied`` with the last token also followed once by the model's other favourite there:
    a 1-gram lookup then draws from two continuations the model finds likely."""
    text = copied[:-6]
    logprobs = next(generate_step(mx.array(copied), small, max_tokens=1))[1]
    ranked = [int(t) for t in np.argsort(-np.array(logprobs))]
    other = next(t for t in ranked if t != text[6])
    return [*text, text[5], other, *text[:6]]


def lookup_pairs(model, prompt, drafter, samples: int, sampler=None) -> np.ndarray:
    return sampled_pairs(
        model,
        prompt,
        SMALL_VOCAB,
        samples,
        sampler=sampler or make_sampler(temp=1.0),
        drafter=drafter,
        num_draft_tokens=2,
    )


def without_residual(probs, tokens, draft_probs, eos, key, **options):
    """A classic bug: after a rejection, ``next`` drawn from p instead of the residual."""
    result = accept_sampled(probs, tokens, draft_probs, eos, key, **options)
    row = mx.take(probs, result[0], axis=0)
    token = mx.random.categorical(mx.log(row), key=mx.random.split(key)[1])
    return mx.stack([result[0], token.astype(mx.uint32), result[2]])


def test_lookup_single_guess_has_the_target_distribution(small, copied) -> None:
    expected = exact_joint(small, copied, SMALL_VOCAB)
    counts = lookup_pairs(small, copied, PromptLookupDrafter(max_ngram=2), 1000)
    assert chi_square_p(counts, expected) > THRESHOLD


def test_negative_control_single_guess_without_residual_fails(small, copied, monkeypatch):
    monkeypatch.setattr(rules, "sampled_decision", without_residual)
    expected = exact_joint(small, copied, SMALL_VOCAB)
    counts = lookup_pairs(small, copied, PromptLookupDrafter(max_ngram=2), 1000)
    assert chi_square_p(counts, expected) < THRESHOLD


@pytest.mark.statistical
def test_lookup_distribution_has_the_target_distribution(small, branching) -> None:
    drafter = PromptLookupDrafter(max_ngram=1, distribution=True)
    expected = exact_joint(small, branching, SMALL_VOCAB)
    counts = lookup_pairs(small, branching, drafter, 1500)
    assert chi_square_p(counts, expected) > THRESHOLD


@pytest.mark.statistical
def test_negative_control_distribution_without_residual_fails(small, branching, monkeypatch):
    monkeypatch.setattr(rules, "sampled_decision", without_residual)
    drafter = PromptLookupDrafter(max_ngram=1, distribution=True)
    expected = exact_joint(small, branching, SMALL_VOCAB)
    counts = lookup_pairs(small, branching, drafter, 1500)
    assert chi_square_p(counts, expected) < THRESHOLD


def test_lookup_distribution_mode_proposes_real_distributions(branching) -> None:
    # Guards the two tests above: the first draft is drawn from two continuations.
    drafter = PromptLookupDrafter(max_ngram=1, distribution=True)
    text = Text(mx.array(branching, dtype=mx.uint32), branching)
    drafter.start(text, DraftSetup(Rule("sampled", make_sampler(temp=1.0)), seed=0))
    supports = [int((np.array(drafter.propose(text, 1, None).probs) > 0).sum()) for _ in range(20)]
    assert max(supports) > 1


@pytest.mark.statistical
@pytest.mark.parametrize("distribution", [False, True])
@pytest.mark.parametrize(
    ("temp", "filters"),
    [(1.0, {"top_p": 0.8}), (1.0, {"top_k": 5}), (1.0, {"min_p": 0.1}), (0.7, {})],
)
def test_lookup_first_two_tokens_with_filters(
    small, copied, branching, temp, filters, distribution
) -> None:
    prompt = branching if distribution else copied
    drafter = PromptLookupDrafter(max_ngram=1 if distribution else 2, distribution=distribution)
    expected = exact_joint(small, prompt, SMALL_VOCAB, temp, **filters)
    sampler = make_sampler(temp=temp, **filters)
    counts = lookup_pairs(small, prompt, drafter, 2000, sampler)
    assert chi_square_p(counts, expected) > THRESHOLD


def test_lookup_sampled_with_the_same_key_repeats(target) -> None:
    sampler = make_sampler(temp=1.0)
    for distribution in (False, True):
        drafter = PromptLookupDrafter(distribution=distribution)
        a, _, _ = run(PROMPT, target, None, drafter=drafter, sampler=sampler, key=mx.random.key(3))
        b, _, _ = run(PROMPT, target, None, drafter=drafter, sampler=sampler, key=mx.random.key(3))
        c, _, _ = run(PROMPT, target, None, drafter=drafter, sampler=sampler, key=mx.random.key(4))
        assert a == b != c


# --- the API -------------------------------------------------------------------------------------


class Fixed(Drafter):
    """Always proposes ``tokens`` (cut to ``n``): a drafter of the user's own."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.kept: list[int] = []

    def propose(self, text, n, key) -> Draft:
        dtype = mx.int32 if min(self.tokens, default=0) < 0 else mx.uint32
        return Draft(mx.array(self.tokens[:n], dtype=dtype))

    def update(self, text, accepted) -> None:
        self.kept.append(accepted)


def test_a_drafter_of_ones_own_is_told_what_was_kept(target, greedy_reference) -> None:
    fixed = Fixed(greedy_reference[:3])
    tokens, _, stats = run(PROMPT, target, None, drafter=fixed, num_draft_tokens=3, max_tokens=20)
    assert tokens == greedy_reference[:20]
    # Round 1 keeps the three tokens; later rounds propose the same ones, which are wrong.
    assert fixed.kept[0] == 3 and stats.accepted == sum(fixed.kept)


class Malformed(Drafter):
    """Returns ``draft`` whatever it is asked: a drafter of one's own with a bug."""

    def __init__(self, draft: object) -> None:
        self.draft = draft

    def propose(self, text, n, key) -> Draft:
        return self.draft


@pytest.mark.parametrize(
    ("draft", "problem"),
    [
        ([1, 2], "a list"),
        (Draft(mx.array([1.0, 2.0])), r"tokens of shape \(2,\) and dtype float32"),
        (Draft(mx.array([[1, 2]], dtype=mx.uint32)), r"tokens of shape \(1, 2\)"),
        (Draft(mx.array([1, 2, 3, 4], dtype=mx.uint32)), "4 tokens"),
        (Draft(mx.array([1, 2], dtype=mx.uint32), mx.ones((3, 8))), r"probs of shape \(3, 8\)"),
    ],
)
def test_a_malformed_proposal_raises_naming_the_drafter(target, draft, problem) -> None:
    # The rule decides without checking its arguments: the loop checks each proposal instead.
    pattern = (
        r"^speculative_generate_step: Malformed\.propose\(text, 3, key\) must return a Draft of "
        rf"at most 3 tokens, got {problem}"
    )
    with pytest.raises(ValueError, match=pattern):
        run(PROMPT, target, None, drafter=Malformed(draft), num_draft_tokens=3, max_tokens=8)


def test_draft_ids_outside_the_target_vocabulary_are_rejected_not_fed(target, greedy_reference):
    # A draft id the target cannot embed (a larger draft vocabulary) is never fed to the target.
    huge = Fixed([greedy_reference[0], 10**6, 255])
    tokens, _, _ = run(PROMPT, target, None, drafter=huge, num_draft_tokens=3, max_tokens=8)
    assert tokens == greedy_reference[:8]
    assert huge.kept[0] == 1


def test_negative_int32_draft_ids_are_rejected_not_fed(target, greedy_reference):
    # Fed as they are, they index the embedding below its start (-2**31 segfaulted).
    negative = Fixed([greedy_reference[0], -(2**31), -1])
    tokens, _, _ = run(PROMPT, target, None, drafter=negative, num_draft_tokens=3, max_tokens=8)
    assert tokens == greedy_reference[:8]
    assert negative.kept[0] == 1


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({}, "needs a `draft_model`, or a `drafter`"),
        ({"draft": "model", "drafter": "prompt-lookup"}, "not both"),
        ({"drafter": "lookup"}, "`drafter` must be 'prompt-lookup'"),
        ({"drafter": "prompt-lookup", "cache": 3}, "`prompt_cache` must hold the target's 2"),
        ({"draft": "model", "cache": 4}, "followed by the draft model's 1"),
        ({"drafter": "prompt-lookup", "adaptive": 1}, "`adaptive` must be a bool"),
        ({"drafter": "prompt-lookup", "num_draft_tokens": 129}, "`num_draft_tokens`"),
    ],
)
def test_drafter_arguments_are_checked(target, drafts, kwargs, match) -> None:
    from mlx_lm.models.cache import make_prompt_cache

    draft = drafts["truncated"] if kwargs.pop("draft", None) else None
    if "cache" in kwargs:
        kwargs["prompt_cache"] = [
            c for _ in range(kwargs.pop("cache")) for c in make_prompt_cache(drafts["truncated"])
        ]
    with pytest.raises(ValueError, match=rf"speculative_generate_step: .*{match}"):
        speculative_generate_step(mx.array(PROMPT), target, draft, **kwargs)


def test_patch_with_prompt_lookup_speculates_without_a_draft_model(target, monkeypatch) -> None:
    from helpers import ByteTokenizer

    plain = lm_generate.generate(target, ByteTokenizer(), PROMPT, max_tokens=60)
    seen = []
    original = loop.Generation.round

    def counted(self, n, remaining):
        seen.append(type(self.drafter).__name__)
        return original(self, n, remaining)

    monkeypatch.setattr(loop.Generation, "round", counted)
    patch_mlx_lm(prompt_lookup=True)
    try:
        import mlx_lm

        text = mlx_lm.generate(target, ByteTokenizer(), PROMPT, max_tokens=60)
    finally:
        unpatch_mlx_lm()
    assert text == plain
    assert seen and set(seen) == {"PromptLookupDrafter"}
    # Unpatched again: mlx-lm's own loop.
    seen.clear()
    lm_generate.generate(target, ByteTokenizer(), PROMPT, max_tokens=10)
    assert not seen


# --- the draft length ----------------------------------------------------------------------------


def feed(lengths: DraftLength, rounds: int, acceptance: float, cost, pending: int = 1) -> list[int]:
    """Runs ``rounds`` simulated rounds: each draft token kept while a fixed stream of uniforms
    stays under ``acceptance``; each round costing ``cost(fed, steps)`` seconds."""
    uniforms = iter(np.random.default_rng(0).random(rounds * 200))
    chosen = []
    for _ in range(rounds):
        n = lengths.choose(pending, 64)
        chosen.append(n)
        accepted = 0
        while accepted < n and next(uniforms) < acceptance:
            accepted += 1
        lengths.record(n, accepted, pending + n, n, cost(pending + n, n))
    return chosen


def _loop_like(
    lengths: DraftLength, choices: int, acceptance: float, cost, plain: float, restart: float = 0.0
):
    """The choices of a draft model's generation made as the loop makes them: a choice of 0 runs
    a stretch of plain steps (8, then twice as many up to 64, until a round) at ``plain`` seconds
    a token, its first step ``restart`` seconds more; a round of the ``i``-th choice drafting
    ``n`` tokens keeps each while a fixed stream of uniforms stays under ``acceptance`` and takes
    ``cost(i, n)`` seconds."""
    uniforms = iter(np.random.default_rng(1).random(choices * 200))
    chosen, stretch = [], 8
    for i in range(choices):
        n = lengths.choose(1, 64)
        chosen.append(n)
        if n == 0:
            lengths.ran_plain(stretch)
            lengths.record_restart(plain + restart)
            lengths.record_plain(plain + restart / stretch)
            stretch = min(2 * stretch, 64)
            continue
        stretch = 8
        accepted = 0
        while accepted < n and next(uniforms) < acceptance:
            accepted += 1
        lengths.record(n, accepted, 1 + n, n, cost(i, n))
    return chosen


def _gpu_like_generation(lengths: DraftLength, choices: int, acceptance: float) -> list[int]:
    """:func:`_loop_like` where a round costs 3.7 plain steps and 0.12 a draft token (a GPU on
    which a round costs several steps)."""
    return _loop_like(lengths, choices, acceptance, lambda i, n: 3.7 + 0.12 * n, 1.0)


@pytest.mark.parametrize("replays", [False, True])
def test_the_choice_maximises_the_expected_tokens_per_second(replays) -> None:
    # Against the rule as the module states it, written out term by term: E(N) = 1 + s(1) + ...
    # + s(N) with s(i) = a1 * a^(i - 1), over base + slope * (pending + N) (prompt lookup), plus
    # with replays slope * ((1 - s(N)) * pending + sum_{i<N} i * (s(i) - s(i + 1))); 0 (plain
    # steps) unless some N beats the plain cost.
    rng = np.random.default_rng(3)
    for case in range(40):
        base, slope, plain = rng.uniform(0.5, 3.0), rng.uniform(0.0, 0.5), rng.uniform(0.5, 1.5)
        lengths = DraftLength(16, adaptive=True, free=True, stretches=True)
        for drafted in (1, 16, 1, 16):  # rounds of exact costs: the fit recovers base and slope
            lengths.record(drafted, 0, drafted + 1, 0, base + slope * (drafted + 1))
        lengths.record_plain(plain)
        for success in rng.random(int(rng.integers(0, 30))) < rng.random():
            lengths.shadow(int(success) * 2, 2, label=2)
        a1, a = lengths.acceptance(2)
        pending, top = int(rng.integers(1, 4)), int(rng.integers(1, 17))
        survival = [1.0] + [a1 * a ** (i - 1) for i in range(1, top + 2)]
        best, best_rate = 0, 1 / plain
        for n in range(1, top + 1):
            cost = base + slope * (pending + n)
            if replays:
                kept = sum(i * (survival[i] - survival[i + 1]) for i in range(n))
                cost += slope * ((1 - survival[n]) * pending + kept)
            rate = sum(survival[: n + 1]) / cost
            if rate > best_rate * (1 + 1e-6):
                best, best_rate = n, rate
        assert lengths._best(pending, top, replays, 2) == best, case


def test_fixed_length_always_drafts_the_most() -> None:
    assert feed(DraftLength(5, adaptive=False), 20, 0.1, lambda fed, steps: 1.0) == [5] * 20


def test_adaptive_length_drafts_long_when_verification_is_flat() -> None:
    # A GPU-like cost (scoring more positions is nearly free) and well-kept drafts: long drafts.
    chosen = feed(DraftLength(8, adaptive=True), 120, 0.9, lambda fed, steps: 1.0 + 0.01 * fed)
    assert np.median(chosen[-60:]) >= 7


def test_adaptive_length_stops_drafting_when_drafts_are_not_kept() -> None:
    # A CPU-like cost (each scored position costs a third of a step) and drafts never kept.
    chosen = feed(DraftLength(8, adaptive=True), 600, 0.0, lambda fed, steps: 1.0 + 0.35 * fed)
    assert np.median(chosen[-300:]) == 0
    # Exploration still drafts now and then (once 128 plain steps ran), so a change would be
    # noticed.
    assert 0 < sum(n > 0 for n in chosen[-300:]) <= 300 // 128 + 1


def test_adaptive_length_is_moderate_when_positions_cost() -> None:
    # CPU-like cost and drafts kept 80% of the time: the best N is small but not zero
    # (E(N) / (1 + 0.35 (N + 1)) peaks at N = 2 or 3).
    chosen = feed(DraftLength(8, adaptive=True), 200, 0.8, lambda fed, steps: 1.0 + 0.35 * fed)
    assert 2 <= np.median(chosen[-100:]) <= 4


def test_a_second_generation_starts_from_the_costs_the_first_measured(
    target, greedy_reference, monkeypatch
) -> None:
    # The first generation drafts the most and then one token to measure what a draft token
    # costs; the next one of the same target and drafter starts from what it measured, and a
    # generation with another target measures anew.
    from tiny_models import tiny_llama

    started = []
    init = DraftLength.__init__

    def spy(self, *args, **kwargs):
        init(self, *args, **kwargs)
        measured = self._slope is not None
        started.append((len(self._rounds), measured, len(self._plain), bool(self._first)))

    monkeypatch.setattr(DraftLength, "__init__", spy)
    options = dict(drafter="prompt-lookup", adaptive=True, max_tokens=120)
    first, _, _ = run(PROMPT, target, None, **options)
    second, _, _ = run(PROMPT, target, None, **options)
    other = tiny_llama(3)
    run(PROMPT, other, None, **options)
    assert first == second == greedy_reference[:120]
    assert started[0] == (0, False, 0, False)
    rounds, measured, plain, first = started[1]
    assert rounds >= 2 and measured and plain >= 1 and first
    assert started[2] == (0, False, 0, False)


def test_kept_costs_go_with_their_models() -> None:
    from tiny_models import cut, tiny_llama

    from mlx_spec.draft_length import Measured, cost_key, forget_costs, keep, recall

    target = tiny_llama(4)
    draft = cut(target, 1)
    costs = Measured([(1, 4, 0.01), (1, 1, 0.005)], [0.002], {0: (2.5, 3.0)}, (1.5, 2.0))
    by_model = cost_key(target, draft, mx.Device(mx.cpu))
    by_class = cost_key(target, PromptLookupDrafter, mx.Device(mx.cpu))
    keep(by_model, costs)
    keep(by_class, costs)
    assert recall(by_model) == costs and recall(by_model) is not costs
    assert recall(cost_key(target, draft, "other device")) is None
    del draft
    gc.collect()
    assert recall(by_model) is None and recall(by_class) == costs
    forget_costs()
    assert recall(by_class) is None


def test_adaptive_length_recovers_from_a_first_round_far_too_slow() -> None:
    # A GPU-like cost, drafts kept 90% of the time and plain steps (in stretches) at 0.6 a token:
    # drafting the most pays (about 6 tokens for 1.4). The first round, a first use, takes 6
    # more: the first slope says drafting does not pay, and later pairs must correct it.
    lengths = DraftLength(8, adaptive=True, stretches=True)
    chosen = _loop_like(lengths, 300, 0.9, lambda i, n: 1.0 + 0.05 * n + 6.0 * (i == 0), 0.6)
    assert chosen[1:20].count(0) > 0  # the outlier did mislead it at first
    assert np.median(chosen[-100:]) >= 7


def test_a_second_generation_starts_from_the_acceptance_the_first_measured() -> None:
    # Drafts kept 90% of the time: 8 of them yield about 6 tokens for 4.7 plain steps. Without
    # the first generation's acceptance the next one starts from the prior (2/3), under which
    # drafting does not pay, and it would not draft to learn better (the negative control).
    from mlx_spec.draft_length import Measured

    first = DraftLength(8, adaptive=True, stretches=True)
    assert np.median(_gpu_like_generation(first, 100, 0.9)[-50:]) >= 7
    kept = first.measured()
    second = DraftLength(8, adaptive=True, stretches=True, kept=kept)
    assert second.acceptance() == pytest.approx(first.acceptance())
    assert second.choose(1, 64) >= 7
    costs_only = Measured(kept.rounds, kept.plain)
    assert DraftLength(8, adaptive=True, stretches=True, kept=costs_only).choose(1, 64) == 0


def test_kept_acceptance_weighs_as_a_few_tested_tokens() -> None:
    # One rejected first token barely moves it; ten of a new text outweigh it. Kept at full
    # weight (about 30 rounds' worth), ten would leave it above one half.
    kept = DraftLength(8, adaptive=True)
    for _ in range(200):
        kept.shadow(1, 1)
    assert kept.acceptance()[0] > 0.95
    second = DraftLength(8, adaptive=True, kept=kept.measured())
    second.shadow(0, 1)
    assert second.acceptance()[0] > 0.85
    for _ in range(9):
        second.shadow(0, 1)
    assert second.acceptance()[0] < 0.5


def test_drafts_are_verified_again_after_many_plain_steps() -> None:
    # Drafting does not pay (drafts never kept): plain steps, counted by the stretch (or as
    # rounds without drafts). Once 128 ran since the last round with drafts, a round of the most
    # comes, then after as many again one of one token (the slope measured far apart), whatever
    # the number of choices in between.
    lengths = DraftLength(8, adaptive=True, stretches=True)
    lengths.record(8, 0, 9, 8, 3.0)
    lengths.record(1, 0, 2, 1, 1.5)
    lengths.record_plain(0.5)
    for _ in range(10):
        assert lengths.choose(1, 64) == 0
    lengths.ran_plain(127)
    assert lengths.choose(1, 64) == 0
    lengths.ran_plain(1)
    assert lengths.choose(1, 64) == 8
    lengths.record(8, 0, 9, 8, 3.0)
    assert lengths.choose(1, 64) == 0
    for _ in range(128):
        lengths.record(0, 0, 1, 0, 0.5)
    assert lengths.choose(1, 64) == 1


def test_a_draft_model_never_kept_costs_little_in_rounds() -> None:
    # Stretches of 8, 16, 32, then 64 plain steps: a round comes once 128 ran since the last
    # one, not more often (which would lose more than a few percent to rounds drafting in vain).
    chosen = _gpu_like_generation(DraftLength(8, adaptive=True, stretches=True), 60, 0.0)
    after = chosen[10:]
    assert after.count(0) >= 40
    assert 0 < sum(n > 0 for n in after) <= len(after) // 5 + 1


def test_acceptance_is_estimated_for_each_label_apart() -> None:
    # Prompt lookup's proposals from a 3-gram always kept, from a 1-gram never: on a GPU-like cost
    # (a round costs 2.3 plain steps) only the first kind is worth verifying.
    lengths = DraftLength(8, adaptive=True, free=True, stretches=True)
    lengths.record(8, 8, 9, 0, 2.3 + 0.08 * 9, label=3)
    lengths.record(1, 0, 2, 0, 2.3 + 0.08 * 2, label=1)
    lengths.record_plain(1.0)
    for _ in range(20):
        lengths.shadow(1, 1, label=3)
        lengths.shadow(0, 1, label=1)
    assert lengths.acceptance(3)[0] > 0.9 > 0.1 > lengths.acceptance(1)[0]
    assert lengths.cost(1, 8) == pytest.approx(2.3 + 0.08 * 9)
    assert lengths.pays(3) and not lengths.pays(1)
    assert lengths.choose(1, 64, label=3) >= 7
    # A later draft token's chance is shared: one kept copy of 8 tokens raised it for all labels.
    assert lengths.acceptance(1)[1] == lengths.acceptance(3)[1] > 0.8


def _copying(restart: float | None) -> DraftLength:
    """Adaptive prompt-lookup lengths on a GPU-like cost (a round 2 plain steps and 0.05 a
    position) whose 3-gram proposals are nearly always kept, and whose stretches' first steps
    took ``restart`` plain steps more than the later ones (``None``: not measured)."""
    lengths = DraftLength(8, adaptive=True, free=True, stretches=True)
    for drafted in (1, 8, 1, 8):
        lengths.record(drafted, 0, drafted + 1, 0, 2.0 + 0.05 * (drafted + 1))
    lengths.ran_plain(8)
    lengths.record_plain(1.0)
    for _ in range(30):
        lengths.shadow(1, 1, label=3)
    if restart is not None:
        lengths.record_restart(1.0 + restart)
    return lengths


def test_lone_rounds_pay_for_restarting_the_plain_steps_after_them() -> None:
    # Drafting 7 or 8 from a 3-gram yields about 3.8 tokens for 2.45 plain steps' time. A round
    # between plain steps also makes the next stretch start its pipeline again: 3 steps more
    # here, which it no longer beats. Rounds that follow rounds (a copy going on) pay it once.
    lone, chained, unmeasured = _copying(3.0), _copying(3.0), _copying(None)
    for lengths in (lone, unmeasured):
        for _ in range(20):
            lengths.record(1, 0, 2, 0, 2.1)
            lengths.no_proposal()  # nothing to propose after it: plain steps follow
            lengths.ran_plain(8)
    for _ in range(20):
        chained.record(1, 0, 2, 0, 2.1)
        chained.choose(1, 8, label=3)  # a 3-gram's proposal next, worth a round but for restarts
    assert unmeasured._best(1, 8, False, 3) > 0  # the control: without the restart it pays
    assert lone._best(1, 8, False, 3) == 0 and not lone.pays(3)
    assert chained._best(1, 8, False, 3) > 0 and chained.pays(3)
    # Without stretches (a group's rounds of one step) there is no pipeline to restart.
    grouped = DraftLength(8, adaptive=True, free=True, kept=lone.measured())
    grouped.record_plain(1.0)
    for _ in range(30):
        grouped.shadow(1, 1, label=3)
    assert grouped._best(1, 8, False, 3) > 0


def test_a_restart_does_not_stop_a_draft_model_whose_rounds_pay() -> None:
    # A draft model's rounds follow each other while they pay, so the restart after them is paid
    # once. Charging every round for it (as if plain steps followed each) would make drafting not
    # pay on this GPU-like cost (a round 3.7 plain steps, a restart 3 more); every round's
    # follower would then be plain steps, and it would stay so.
    lengths = DraftLength(8, adaptive=True, stretches=True)
    chosen = _loop_like(lengths, 80, 0.85, lambda i, n: 3.7 + 0.12 * n, 1.0, 3.0)
    assert sum(n > 0 for n in chosen[-40:]) >= 35
    lengths._ends = [1.0, 1.0]  # the control: as if plain steps had followed every round
    assert lengths._best(1, 8, False, 0) == 0


def test_restarts_are_measured_against_plain_steps_and_kept() -> None:
    lengths = DraftLength(8, adaptive=True, free=True, stretches=True)
    lengths.record_restart(5.0)  # before any plain step was measured: nothing to compare with
    lengths.record_plain(1.0)
    lengths.record_restart(3.5)
    lengths.record_restart(0.5)  # a first step no slower than the others costs nothing more
    assert lengths.measured().restarts == [2.5, 0.0]
    second = DraftLength(8, adaptive=True, free=True, stretches=True, kept=lengths.measured())
    assert second.measured().restarts == [2.5, 0.0]


def test_each_stretch_reports_its_first_step_apart(target, monkeypatch) -> None:
    # The first step of a stretch waits for its own host work: each stretch reports it as a
    # restart, then (run to its end) what a token of it cost.
    events = []
    stretch = loop.Generation.stretch

    def counted(self, count):
        events.append(("stretch", count))
        yield from stretch(self, count)

    monkeypatch.setattr(loop.Generation, "stretch", counted)
    monkeypatch.setattr(DraftLength, "pays", lambda self, label, replays=False: False)
    monkeypatch.setattr(DraftLength, "choose", lambda self, *args, **kwargs: 0)
    monkeypatch.setattr(DraftLength, "record_restart", lambda self, s: events.append(("first", s)))
    monkeypatch.setattr(DraftLength, "record_plain", lambda self, s: events.append(("plain", s)))
    run(PROMPT, target, None, drafter="prompt-lookup", adaptive=True, max_tokens=130)
    kinds = [kind for kind, _ in events]
    assert kinds == ["stretch", "first", "plain"] * 5
    assert [count for kind, count in events if kind == "stretch"] == [8, 16, 32, 64, 10]
    assert all(seconds > 0 for kind, seconds in events if kind != "stretch")


def test_stretch_guesses_follow_the_text(target, monkeypatch) -> None:
    # In a stretch of plain steps, prompt lookup's guess for each token must come from the text
    # up to it (its acceptance is measured from these guesses), not from where the stretch began.
    seen = []
    propose = PromptLookupDrafter.propose

    def spy(self, text, n, key):
        seen.append(len(self._index.ids) == len(text))
        return propose(self, text, n, key)

    monkeypatch.setattr(PromptLookupDrafter, "propose", spy)
    monkeypatch.setattr(DraftLength, "pays", lambda self, label, replays=False: False)
    run(PROMPT, target, None, drafter="prompt-lookup", adaptive=True, max_tokens=200)
    assert len(seen) > 100 and all(seen)


def test_stretches_cut_short_by_a_proposal_stay_lossless(target, greedy_reference, monkeypatch):
    # Every proposal worth verifying: each stretch ends after the step started when a guess was
    # right, with no further step built ahead; the text is still plain greedy decoding's.
    ends = []
    stretch = loop.Generation.stretch

    def counted(self, count):
        made = 0
        for step in stretch(self, count):
            made += 1
            yield step
        ends.append(made < count)

    monkeypatch.setattr(loop.Generation, "stretch", counted)
    monkeypatch.setattr(DraftLength, "pays", lambda self, label, replays=False: True)
    # Rounds of two drafts wherever lookup proposes (whatever the clock measured).
    monkeypatch.setattr(DraftLength, "choose", lambda self, pending, cap, *_, **__: min(2, cap))
    tokens, _, stats = run(
        PROMPT, target, None, drafter="prompt-lookup", adaptive=True, max_tokens=300
    )
    assert tokens == greedy_reference
    assert sum(ends) >= 3 and stats.drafted > 0


def test_stretches_double_until_a_round_starts_them_short_again(target, monkeypatch) -> None:
    # Prompt lookup's guesses are often right on the tiny target's text, but none is worth
    # verifying: consecutive stretches still double (each starts its pipeline anew), up to the
    # longest. After a round, the next stretch is short again.
    events = []
    stretch, round_ = loop.Generation.stretch, loop.Generation.round

    def counted(self, count):
        events.append(count)
        yield from stretch(self, count)

    def logged(self, n, remaining):
        events.append("round")
        return round_(self, n, remaining)

    def expected(events):
        since = 0
        for event in events:
            if event == "round":
                since = 0
                continue
            yield min(loop.STRETCH * 2**since, loop.LONGEST_STRETCH)
            since += 1

    monkeypatch.setattr(loop.Generation, "stretch", counted)
    monkeypatch.setattr(loop.Generation, "round", logged)
    monkeypatch.setattr(DraftLength, "pays", lambda self, label, replays=False: False)
    monkeypatch.setattr(DraftLength, "choose", lambda self, *args, **kwargs: 0)
    _, _, stats = run(PROMPT, target, None, drafter="prompt-lookup", adaptive=True, max_tokens=300)
    assert stats.drafted == 0 and "round" not in events
    assert events[:5] == [8, 16, 32, 64, 64]
    assert (loop.STRETCH, loop.LONGEST_STRETCH) == (8, 64)
    # The last stretch is cut to the tokens left.
    assert events[:-1] == list(expected(events))[:-1]

    # A round of one draft token at every third choice.
    choices = itertools.cycle([0, 0, 1])
    monkeypatch.setattr(DraftLength, "choose", lambda self, *args, **kwargs: next(choices))
    events.clear()
    run(PROMPT, target, None, drafter="prompt-lookup", adaptive=True, max_tokens=300)
    stretches = [event for event in events if event != "round"]
    assert events.count("round") >= 3 and stretches.count(loop.STRETCH) >= 3
    assert stretches[:-1] == list(expected(events))[:-1]


def test_fixed_length_flushes_replays_that_grew() -> None:
    lengths = DraftLength(3, adaptive=False)
    assert lengths.choose(pending=4, cap=64, replays=True) == 3
    assert lengths.choose(pending=5, cap=64, replays=True) == 0
    assert lengths.choose(pending=5, cap=64, replays=False) == 3


def test_a_round_far_slower_than_the_rest_barely_moves_the_costs() -> None:
    # A compilation or a first use: the medians ignore one outlier.
    lengths = DraftLength(4, adaptive=True)
    feed(lengths, 30, 0.7, lambda fed, steps: 1.0 + 0.1 * fed)
    before = lengths.cost(1, 4)
    lengths.record(4, 2, 5, 4, 1000.0)
    assert lengths.cost(1, 4) == pytest.approx(before, rel=0.05)


def test_the_slope_follows_paired_rounds_despite_drift() -> None:
    # Every round costs 0.1 more than the one before (a machine getting busier): pairs of
    # consecutive rounds still measure 0.3 a draft token.
    lengths = DraftLength(8, adaptive=True, free=True)
    clock = iter(range(10_000))
    feed(lengths, 60, 0.7, lambda fed, steps: 1.0 + 0.3 * fed + 0.1 * next(clock))
    assert lengths._slope == pytest.approx(0.3, abs=0.12)


def test_text_views_agree() -> None:
    text = Text(mx.array([4, 5, 6], dtype=mx.uint32), [4, 5, 6])
    text.extend([7, 8])
    assert len(text) == 5
    assert text.ids(1) == [5, 6, 7, 8] and text.ids(3, 4) == [7]
    assert text.tokens(2).tolist() == [6, 7, 8] and text.tokens(0, 2).tolist() == [4, 5]
    assert text.array().tolist() == [4, 5, 6, 7, 8]
    assert drafters.__all__
