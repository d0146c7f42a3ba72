"""Drafters: prompt lookup (its index, its proposals, lossless generation at any temperature),
the model drafter through the same interface, drafters of one's own, and the stretches of plain
steps the loop runs where drafting does not pay."""

from __future__ import annotations

import importlib
import itertools
import subprocess
import sys
from pathlib import Path
from typing import ClassVar

import mlx.core as mx
import numpy as np
import pytest
from first_tokens import (
    POWER,
    THRESHOLD,
    WRONG_TEMPERATURE,
    chi_square_p,
    chi_square_power,
    exact_joint,
    sampled_pairs,
)
from helpers import PROMPT, Silent, run
from mlx_lm import load
from mlx_lm.generate import generate_step
from tiny_models import tiny_llama

import mlx_spec
from mlx_spec import drafters, loop, rules
from mlx_spec.acceptance import accept_sampled
from mlx_spec.draft_length import Outcome, Round
from mlx_spec.drafters import Draft, Drafter, DraftSetup, PromptLookupDrafter
from mlx_spec.generation import SpeculativeStats, speculative_generate_step
from mlx_spec.keys import KeyChain
from mlx_spec.loop import Text
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
    drafter.start(text, DraftSetup(Rule("residual", make_sampler(temp=1.0))))
    firsts = []
    keys = mx.random.split(mx.random.key(5), 600)
    for i in range(600):
        draft = drafter.propose(text, 1, keys[i : i + 1])
        q = np.array(draft.probs)[0]
        np.testing.assert_allclose(q[[3, 5]], [2 / 3, 1 / 3], rtol=1e-6)
        assert q.sum() == pytest.approx(1.0) and np.count_nonzero(q) == 2
        firsts.append(draft.tokens.item())
    share = firsts.count(3) / len(firsts)
    # 600 draws of a 2/3 coin: 5 standard deviations is 0.096.
    assert abs(share - 2 / 3) < 0.096 and set(firsts) == {3, 5}


def test_distribution_mode_draws_with_the_positions_keys_when_coupled() -> None:
    # Coupled, a lookup draft is the draw the target's token at that position takes from the
    # same state: from the frequencies alone, it is mx.random.categorical of their logarithm.
    ids = [1, 2, 3, 1, 2, 5, 1, 2, 3, 9, 1, 2]
    drafter = PromptLookupDrafter(max_ngram=2, min_ngram=2, distribution=True)
    text = Text(mx.array(ids, dtype=mx.uint32), ids)
    drafter.start(text, DraftSetup(Rule("coupled", make_sampler(temp=1.0), vocab=16)))
    chain = KeyChain(mx.random.key(0))
    scores = np.full((1, 16), -np.inf, dtype=np.float32)
    scores[0, [3, 5]] = np.log([2 / 3, 1 / 3])
    drawn, expected = [], []
    for position in range(200):
        draft = drafter.propose(text, 1, chain.keys(position, 1))
        assert draft.probs is None
        drawn.append(draft.tokens.item())
        # The key mx.random's sequence hands out at the position's state.
        key = mx.random.split(chain.state(position))[1]
        expected.append(mx.random.categorical(mx.array(scores), key=key).item())
    assert drawn == expected and set(drawn) == {3, 5}


# --- lossless at temperature 0 -------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo():
    folder = Path(mlx_spec.__file__).parent / "demo"
    model, tokenizer = load(str(folder / "target"))
    return model, tokenizer


@pytest.fixture(scope="module")
def copying_code(demo):
    """A prompt of the demo target's that holds code the output repeats, and a function giving
    plain greedy decoding's first tokens after it (computed once for the longest asked)."""
    model, tokenizer = demo
    code = "def read_file(path):\n    with open(path) as f:\n        return f.read()\n\n"
    prompt = mx.array(tokenizer.encode(code * 3 + "def read_file(path):\n"))
    computed: list[int] = []

    def plain(tokens: int) -> list[int]:
        if len(computed) < tokens:
            computed[:] = [t for t, _ in generate_step(prompt, model, max_tokens=tokens)]
        return computed[:tokens]

    return prompt, plain


@pytest.mark.parametrize(
    ("n", "tokens"),
    [
        pytest.param(8, 100, marks=pytest.mark.quick_only),
        *(pytest.param(n, 300, marks=pytest.mark.slow) for n in (1, 3, 8)),
    ],
)
def test_lookup_greedy_equals_plain_on_the_demo_target_copying_code(
    demo, copying_code, n, tokens
) -> None:
    # Input-grounded: the prompt holds code that the output repeats, so lookups keep matching.
    # The quick run checks the longest drafts over 100 tokens; --full each N over 300.
    model, _ = demo
    prompt, plain = copying_code
    stats = SpeculativeStats()
    steps = speculative_generate_step(
        prompt, model, drafter="prompt-lookup", num_draft_tokens=n, max_tokens=tokens, stats=stats
    )
    assert [t for t, _, _ in steps] == plain(tokens)
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
# Sample sizes, each the least that gives the negative control beside its tests a chance of at
# least 0.999 to fail (first_tokens.POWER at first_tokens.THRESHOLD). The effects
# sum((w - p)**2 / p) of the controls that break the loop were estimated from their counts over
# M keys, (X^2 - df) / M, over the cells chi_square_p forms at the size; the size is chosen by
# the lower end of the effect's two-standard-error interval:
# - a single guess, coupled: the guess kept by a draw with the next position's state (M = 1000),
#   effect 0.39 (at least 0.31) over 12 cells at 225 keys: power 0.99999 (at least 0.9998);
# - a single guess, residual: `next` drawn from p after a rejection (M = 2000), effect 0.16 (at
#   least 0.12) over 28 cells at 650 keys: power 0.99999 (at least 0.9991);
# - a distribution of guesses: the same bug (M = 2000), effect 0.15 (at least 0.12) over 25
#   cells at 725 keys: power 0.99999 (at least 0.9997);
# - with filters: a sampler at first_tokens.WRONG_TEMPERATURE, whose power is exact
#   (test_the_wrong_temperature_controls_have_their_power): 650 keys after `copied`, 400 after
#   `branching`.
SINGLE = {"coupled": 225, "residual": 650}
DISTRIBUTION = 725
FILTERED = {"copied": 650, "branching": 400}


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


def lookup_pairs(
    model, prompt, drafter, samples: int, sampler=None, acceptance="coupled", prefilled=True
) -> np.ndarray:
    return sampled_pairs(
        model,
        prompt,
        SMALL_VOCAB,
        samples,
        sampler=sampler or make_sampler(temp=1.0),
        drafter=drafter,
        num_draft_tokens=2,
        acceptance=acceptance,
        prefilled=prefilled,
    )


@pytest.mark.parametrize("acceptance", ["coupled", "residual"])
def test_prefilled_lookup_runs_are_the_runs_on_new_caches(small, branching, acceptance) -> None:
    # The statistical tests below start each run from caches holding the prompt's first tokens,
    # which the drafter is given as cached_tokens (first_tokens.sampled_pairs): each key must
    # give the tokens it gives on new caches, with lookup's proposals from the whole prompt.
    drafter = PromptLookupDrafter(max_ngram=1, distribution=True)
    fresh = lookup_pairs(small, branching, drafter, 40, acceptance=acceptance, prefilled=False)
    assert (lookup_pairs(small, branching, drafter, 40, acceptance=acceptance) == fresh).all()
    assert np.count_nonzero(fresh) > 5  # varied pairs, not one repeated


def without_residual(probs, tokens, draft_probs, eos, key, **options):
    """A classic bug: after a rejection, ``next`` drawn from p instead of the residual."""
    result = accept_sampled(probs, tokens, draft_probs, eos, key, **options)
    row = mx.take(probs, result[0], axis=0)
    token = mx.random.categorical(mx.log(row), key=mx.random.split(key)[1])
    return mx.stack([result[0], token.astype(mx.uint32), result[2]])


@pytest.mark.parametrize("acceptance", ["coupled", "residual"])
def test_lookup_single_guess_has_the_target_distribution(small, copied, acceptance) -> None:
    expected = exact_joint(small, copied, SMALL_VOCAB)
    drafter = PromptLookupDrafter(max_ngram=2)
    counts = lookup_pairs(small, copied, drafter, SINGLE[acceptance], acceptance=acceptance)
    assert chi_square_p(counts, expected) > THRESHOLD


def test_negative_control_single_guess_without_residual_fails(small, copied, monkeypatch):
    monkeypatch.setattr(rules, "sampled_decision", without_residual)
    expected = exact_joint(small, copied, SMALL_VOCAB)
    drafter = PromptLookupDrafter(max_ngram=2)
    counts = lookup_pairs(small, copied, drafter, SINGLE["residual"], acceptance="residual")
    assert chi_square_p(counts, expected) < THRESHOLD


def test_negative_control_single_guess_kept_by_its_own_draw_fails(small, copied, monkeypatch):
    # Coupled, a guess must be compared with the target's own token at its position; a bug that
    # keeps it when a draw of the guess's row with the next position's key agrees instead keeps
    # guesses the target would not have drawn. (Shifted where a round verifies a guess only: a
    # shift of every draw, plain steps' too, would be a generation from another key.)
    original = rules.Rule.keys

    def shifted(self, chain, position, n, *, draft):
        return original(self, chain, position + (1 if n and not draft else 0), n, draft=draft)

    monkeypatch.setattr(rules.Rule, "keys", shifted)
    expected = exact_joint(small, copied, SMALL_VOCAB)
    counts = lookup_pairs(small, copied, PromptLookupDrafter(max_ngram=2), SINGLE["coupled"])
    assert chi_square_p(counts, expected) < THRESHOLD


@pytest.mark.statistical
@pytest.mark.parametrize("acceptance", ["coupled", "residual"])
def test_lookup_distribution_has_the_target_distribution(small, branching, acceptance) -> None:
    drafter = PromptLookupDrafter(max_ngram=1, distribution=True)
    expected = exact_joint(small, branching, SMALL_VOCAB)
    counts = lookup_pairs(small, branching, drafter, DISTRIBUTION, acceptance=acceptance)
    assert chi_square_p(counts, expected) > THRESHOLD


@pytest.mark.statistical
def test_negative_control_distribution_without_residual_fails(small, branching, monkeypatch):
    monkeypatch.setattr(rules, "sampled_decision", without_residual)
    drafter = PromptLookupDrafter(max_ngram=1, distribution=True)
    expected = exact_joint(small, branching, SMALL_VOCAB)
    counts = lookup_pairs(small, branching, drafter, DISTRIBUTION, acceptance="residual")
    assert chi_square_p(counts, expected) < THRESHOLD


def test_lookup_distribution_mode_proposes_real_distributions(branching) -> None:
    # Guards the two tests above: the first draft is drawn from two continuations.
    drafter = PromptLookupDrafter(max_ngram=1, distribution=True)
    text = Text(mx.array(branching, dtype=mx.uint32), branching)
    drafter.start(text, DraftSetup(Rule("residual", make_sampler(temp=1.0))))
    keys = mx.random.split(mx.random.key(0), 20)
    supports = [
        int((np.array(drafter.propose(text, 1, keys[i : i + 1]).probs) > 0).sum())
        for i in range(20)
    ]
    assert max(supports) > 1


@pytest.mark.statistical
@pytest.mark.parametrize("acceptance", ["coupled", "residual"])
@pytest.mark.parametrize("distribution", [False, True])
@pytest.mark.parametrize(
    ("temp", "filters"),
    [(1.0, {"top_p": 0.8}), (1.0, {"top_k": 5}), (1.0, {"min_p": 0.1}), (0.7, {})],
)
def test_lookup_first_two_tokens_with_filters(
    small, copied, branching, temp, filters, distribution, acceptance
) -> None:
    prompt = branching if distribution else copied
    drafter = PromptLookupDrafter(max_ngram=1 if distribution else 2, distribution=distribution)
    expected = exact_joint(small, prompt, SMALL_VOCAB, temp, **filters)
    sampler = make_sampler(temp=temp, **filters)
    samples = FILTERED["branching" if distribution else "copied"]
    counts = lookup_pairs(small, prompt, drafter, samples, sampler, acceptance)
    assert chi_square_p(counts, expected) > THRESHOLD


@pytest.mark.statistical
@pytest.mark.parametrize("distribution", [False, True])
def test_negative_control_lookup_wrong_temperature_fails(small, copied, branching, distribution):
    prompt = branching if distribution else copied
    drafter = PromptLookupDrafter(max_ngram=1 if distribution else 2, distribution=distribution)
    expected = exact_joint(small, prompt, SMALL_VOCAB)
    samples = FILTERED["branching" if distribution else "copied"]
    counts = lookup_pairs(small, prompt, drafter, samples, make_sampler(temp=WRONG_TEMPERATURE))
    assert chi_square_p(counts, expected) < THRESHOLD


@pytest.mark.parametrize("prompt", ["copied", "branching"])
def test_the_wrong_temperature_controls_have_their_power(small, request, prompt) -> None:
    # Sampling at WRONG_TEMPERATURE has plain sampling's joint there: the power is exact, and
    # FILTERED the least size with it (to 50 keys), so that no test draws more than it needs.
    text = request.getfixturevalue(prompt)
    expected = exact_joint(small, text, SMALL_VOCAB)
    wrong = exact_joint(small, text, SMALL_VOCAB, WRONG_TEMPERATURE)
    assert chi_square_power(expected, wrong, FILTERED[prompt]) >= POWER
    assert chi_square_power(expected, wrong, FILTERED[prompt] - 50) < POWER


def test_lookup_sampled_with_the_same_key_repeats(target) -> None:
    # 64 tokens, tens of rounds each: keys reused or drawn afresh would part them early.
    options = dict(sampler=make_sampler(temp=1.0), max_tokens=64)
    for distribution in (False, True):
        drafter = PromptLookupDrafter(distribution=distribution)
        a, _, _ = run(PROMPT, target, None, drafter=drafter, key=mx.random.key(3), **options)
        b, _, _ = run(PROMPT, target, None, drafter=drafter, key=mx.random.key(3), **options)
        c, _, _ = run(PROMPT, target, None, drafter=drafter, key=mx.random.key(4), **options)
        assert a == b != c


class KeysSeen(PromptLookupDrafter):
    """Prompt lookup that records whether each proposal was given keys (in the class: a batch
    runs a copy for each row)."""

    given: ClassVar[list[bool]] = []

    def propose(self, text: Text, n: int, keys: mx.array | None) -> Draft:
        KeysSeen.given.append(keys is not None)
        return super().propose(text, n, keys)


@pytest.mark.parametrize("distribution", [False, True])
def test_lookup_is_given_keys_only_where_it_draws(target, distribution) -> None:
    # A copied proposal reads no keys, so neither the loop nor a batch makes any for it; a
    # drawn one gets them, sampled, in both.
    from mlx_spec.batch import SpeculativeBatch

    KeysSeen.given = []
    sampler = make_sampler(temp=1.0)
    drafter = KeysSeen(distribution=distribution)
    run(PROMPT, target, None, drafter=drafter, key=mx.random.key(3), sampler=sampler, max_tokens=24)
    single = KeysSeen.given
    KeysSeen.given = []
    rows = [PROMPT, PROMPT[:9]]
    keys = [mx.random.key(i) for i in range(2)]
    samplers = [sampler] * 2
    batch = SpeculativeBatch(target, rows, [3, 3], [24, 24], [], samplers, keys, drafter=drafter)
    while len(batch):
        batch.next()
    assert single and KeysSeen.given
    assert set(single) == set(KeysSeen.given) == {distribution}


# --- the API -------------------------------------------------------------------------------------


class Fixed(Drafter):
    """Always proposes ``tokens`` (cut to ``n``): a drafter of the user's own."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.kept: list[int] = []

    def propose(self, text, n, keys) -> Draft:
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

    def propose(self, text, n, keys) -> Draft:
        return self.draft


@pytest.mark.parametrize(
    ("draft", "problem"),
    [
        ([1, 2], "a list"),
        (Draft(mx.array([1.0, 2.0])), r"tokens of shape \(2,\) and dtype float32"),
        (Draft(mx.array([[1, 2]], dtype=mx.uint32)), r"tokens of shape \(1, 2\)"),
        (Draft(mx.array([1, 2, 3, 4], dtype=mx.uint32)), "4 tokens"),
        (Draft(mx.array([1, 2], dtype=mx.uint32), mx.ones((3, 8))), r"probs of shape \(3, 8\)"),
        (Draft(mx.array([1, 2], dtype=mx.uint32), label=[2]), "a label of list"),
    ],
)
def test_a_malformed_proposal_raises_naming_the_drafter(target, draft, problem) -> None:
    # The rule decides without checking its arguments: the loop checks each proposal instead.
    pattern = (
        r"^speculative_generate_step: Malformed\.propose\(text, 3, keys\) must return a Draft of "
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
    original = loop.Generation._round

    def counted(self, n, proposal, remaining):
        seen.append(type(self.drafter).__name__)
        return original(self, n, proposal, remaining)

    monkeypatch.setattr(loop.Generation, "_round", counted)
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


# --- stretches of plain steps --------------------------------------------------------------------


class Scripted:
    """A draft-length policy that answers from a list (then the list's last), and records what it
    was told."""

    def __init__(self, *answers: int) -> None:
        self.answers = list(answers)
        self.told: list[Outcome] = []
        self.asked: list[Round] = []

    def choose(self, round: Round) -> int:
        self.asked.append(round)
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        return min(answer, round.cap)

    def observe(self, outcome: Outcome) -> None:
        self.told.append(outcome)


def test_each_plain_step_reports_its_time_and_whether_it_starts_a_stretch(
    target, monkeypatch
) -> None:
    # The policy learns what plain steps cost: each reports its seconds, and the first of each
    # stretch (which waits for its own host work, nothing being in flight) is marked apart.
    stretches = []
    stretch = loop.Generation._stretch

    def counted(self, count, guess):
        stretches.append(count)
        yield from stretch(self, count, guess)

    monkeypatch.setattr(loop.Generation, "_stretch", counted)
    policy = Scripted(2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 0)
    run(PROMPT, target, target, policy=policy, max_tokens=40)
    plain = [o for o in policy.told if o.plain]
    assert plain and any(not o.plain for o in policy.told)
    assert all(o.seconds > 0 for o in policy.told)
    assert sum(o.first for o in plain) == len(stretches) >= 2


def test_stretch_guesses_follow_the_text(target, monkeypatch) -> None:
    # In a stretch of plain steps, prompt lookup's guess for each token must come from the text
    # up to it (its acceptance is measured from these guesses), not from where the stretch began.
    # The proposal that asks the policy after a step is the next step's guess: lookup is asked
    # once a plain step, not a second time for a guess of one token.
    seen = []
    propose = PromptLookupDrafter.propose

    def spy(self, text, n, keys):
        seen.append((len(self._index.ids) == len(text), n))
        return propose(self, text, n, keys)

    monkeypatch.setattr(PromptLookupDrafter, "propose", spy)
    policy = Scripted(0)
    run(PROMPT, target, None, drafter="prompt-lookup", policy=policy, max_tokens=200)
    steps = sum(o.plain for o in policy.told)
    assert len(seen) > 100 and all(current for current, _ in seen)
    assert steps == 200 and len(seen) <= steps + 1
    assert 1 not in [n for _, n in seen[:-1]]
    # Each guess checked against the token the step emitted is reported as tested.
    assert sum(o.drafted for o in policy.told) > 50


def test_stretches_cut_short_by_a_proposal_stay_lossless(target, greedy_reference, monkeypatch):
    # The policy chooses to draft now and then (twice in a row: to end the stretch, then for the
    # round): each stretch ends after the step already started, and the text is still plain
    # greedy decoding's.
    ends = []
    stretch = loop.Generation._stretch

    def counted(self, count, guess):
        made = 0
        for step in stretch(self, count, guess):
            made += 1
            yield step
        ends.append(made < count)

    monkeypatch.setattr(loop.Generation, "_stretch", counted)
    policy = Scripted(*[0, 0, 0, 2, 2] * 200)
    tokens, _, stats = run(
        PROMPT, target, None, drafter="prompt-lookup", policy=policy, max_tokens=300
    )
    assert tokens == greedy_reference
    assert sum(ends) >= 3 and stats.drafted > 0


def test_text_views_agree() -> None:
    text = Text(mx.array([4, 5, 6], dtype=mx.uint32), [4, 5, 6])
    text.extend([7, 8])
    assert len(text) == 5
    assert text.ids(1) == [5, 6, 7, 8] and text.ids(3, 4) == [7]
    assert text.tokens(2).tolist() == [6, 7, 8] and text.tokens(0, 2).tolist() == [4, 5]
    assert text.array().tolist() == [4, 5, 6, 7, 8]
    assert drafters.__all__


def test_mtp_drafter_is_public_in_drafters_without_an_import_cycle() -> None:
    from mlx_spec import mtp

    assert "MTPDrafter" in drafters.__all__
    assert drafters.MTPDrafter is mtp.MTPDrafter is mlx_spec.MTPDrafter
    with pytest.raises(AttributeError, match="has no attribute 'NoDrafter'"):
        drafters.NoDrafter  # noqa: B018
    # The first import of a fresh interpreter: mtp imports drafters, so drafters names it only on
    # first use (a star import asks for each name of __all__).
    run = subprocess.run(
        [sys.executable, "-c", "from mlx_spec.drafters import *; print(MTPDrafter.__module__)"],
        capture_output=True, text=True, timeout=120, cwd=Path(mlx_spec.__file__).parents[1],
    )  # fmt: skip
    assert run.returncode == 0 and run.stdout == "mlx_spec.mtp\n", run.stderr
