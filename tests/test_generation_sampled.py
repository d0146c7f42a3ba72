"""The loop's output has exactly the target's distribution when it samples (a draft model).

The first two tokens after :data:`helpers.PROMPT` are counted over fixed keys and compared with
the exact joint distribution of sampling the target alone (``tests/first_tokens.py``), on a
24-token llama, under both rules: coupled (the default), with the target's first layer as draft,
and residual (rejection sampling), with a draft of another seed that agrees with the target on
about half of its probability mass, where a wrong residual moves the joint most. Negative
controls (a wrong residual, positions sharing their randomness, a wrong temperature) must fail
at the same sample sizes, which a power calculation gives (``tests/first_tokens.py``): each
control fails with a chance of at least 0.999.
"""

from __future__ import annotations

import mlx.core as mx
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
from helpers import PROMPT
from tiny_models import cut, tiny_llama

from mlx_spec import rules
from mlx_spec.acceptance import accept_sampled
from mlx_spec.sampling import make_sampler

RULES = ["coupled", "residual"]

SMALL_VOCAB = 24


# Sample sizes, each the least that gives the control beside it a chance of at least 0.999 to
# fail (first_tokens.POWER at first_tokens.THRESHOLD). The effects sum((w - p)**2 / p) were
# estimated from each control's counts over M keys, (X^2 - df) / M, over the cells chi_square_p
# forms at the size; the power is given for the estimate and for the lower end of its
# two-standard-error interval, which the size is chosen by:
# - COUPLED: positions sharing their randomness (M = 1000), effect 0.41 (at least 0.33) over 11
#   cells at 200 keys: power 0.99999 (at least 0.9996).
# - RESIDUAL: `next` drawn from p after a rejection, with the half-agreeing draft (M = 3000),
#   effect 0.17 (at least 0.14) over 31 cells at 625 keys: power 0.99998 (at least 0.9994).
#   With the first-layer draft, which shares 86% of the first token's mass, the same bug moves
#   the joint by 0.04 only and would need thousands of keys.
# - FULL: the --full tests' control draws at first_tokens.WRONG_TEMPERATURE instead of 1; its
#   power is exact (test_the_wrong_temperature_control_has_its_power): 600 keys.
COUPLED = 200
RESIDUAL = 625
FULL = 600


@pytest.fixture(scope="module")
def small_pair():
    model = tiny_llama(3, vocab=SMALL_VOCAB, head=4.0)
    return model, cut(model, 1)


@pytest.fixture(scope="module")
def half_draft():
    """A draft model of another seed: it shares about half of the target's first-token mass."""
    return tiny_llama(8, vocab=SMALL_VOCAB, head=4.0)


def joint(model, temp: float = 1.0, **filters):
    return exact_joint(model, PROMPT, SMALL_VOCAB, temp, **filters)


def draws(model, draft, sampler, samples: int, acceptance: str = "coupled"):
    return sampled_pairs(
        model,
        PROMPT,
        SMALL_VOCAB,
        samples,
        draft_model=draft,
        sampler=sampler,
        num_draft_tokens=2,
        acceptance=acceptance,
    )


def test_first_two_tokens_of_the_coupled_rule_have_the_target_distribution(small_pair) -> None:
    model, draft = small_pair
    expected = joint(model)
    counts = draws(model, draft, make_sampler(temp=1.0), COUPLED)
    assert chi_square_p(counts, expected) > THRESHOLD


def test_first_two_tokens_of_the_residual_rule_have_the_target_distribution(
    small_pair, half_draft
) -> None:
    model, _ = small_pair
    expected = joint(model)
    counts = draws(model, half_draft, make_sampler(temp=1.0), RESIDUAL, "residual")
    assert chi_square_p(counts, expected) > THRESHOLD


def test_negative_control_positions_sharing_randomness_fails(small_pair, monkeypatch) -> None:
    # A classic bug of coupled sampling: every row of a round drawn with the round's first
    # state, so a kept draft token and the token after it are drawn from one uniform.
    model, draft = small_pair
    expected = joint(model)
    original = rules.Rule.keys

    def shared(self, chain, position, n, *, draft):
        keys = original(self, chain, position, n, draft=draft)
        return mx.broadcast_to(keys[:1], keys.shape) if keys is not None else keys

    monkeypatch.setattr(rules.Rule, "keys", shared)
    counts = draws(model, draft, make_sampler(temp=1.0), COUPLED)
    assert chi_square_p(counts, expected) < THRESHOLD


def test_negative_control_resampling_from_the_target_fails(
    small_pair, half_draft, monkeypatch
) -> None:
    # A classic bug: after a rejection, drawing `next` from p instead of norm(max(p - q, 0)).
    model, _ = small_pair
    expected = joint(model)

    def without_residual(probs, tokens, draft_probs, eos, key, **options):
        result = accept_sampled(probs, tokens, draft_probs, eos, key, **options)
        row = mx.take(probs, result[0], axis=0)
        token = mx.random.categorical(mx.log(row), key=mx.random.split(key)[1])
        return mx.stack([result[0], token.astype(mx.uint32), result[2]])

    monkeypatch.setattr(rules, "sampled_decision", without_residual)
    counts = draws(model, half_draft, make_sampler(temp=1.0), RESIDUAL, "residual")
    assert chi_square_p(counts, expected) < THRESHOLD


@pytest.mark.statistical
@pytest.mark.parametrize("acceptance", RULES)
@pytest.mark.parametrize(
    ("temp", "filters"),
    [
        (0.7, {}),
        (1.0, {"top_p": 0.8}),
        (1.0, {"top_k": 5}),
        (1.0, {"min_p": 0.1}),
        (0.8, {"top_p": 0.9, "min_p": 0.05, "top_k": 8}),
    ],
)
def test_first_two_tokens_with_filters(small_pair, temp, filters, acceptance) -> None:
    model, draft = small_pair
    expected = joint(model, temp, **filters)
    sampler = make_sampler(temp=temp, **filters)
    counts = draws(model, draft, sampler, FULL, acceptance)
    assert chi_square_p(counts, expected) > THRESHOLD


@pytest.mark.statistical
@pytest.mark.parametrize("acceptance", RULES)
def test_first_two_tokens_with_an_unrelated_draft(small_pair, acceptance) -> None:
    model, _ = small_pair
    expected = joint(model)
    unrelated = tiny_llama(9, vocab=SMALL_VOCAB, head=4.0)
    counts = draws(model, unrelated, make_sampler(temp=1.0), FULL, acceptance)
    assert chi_square_p(counts, expected) > THRESHOLD


@pytest.mark.statistical
def test_negative_control_wrong_temperature_fails(small_pair) -> None:
    model, draft = small_pair
    expected = joint(model)
    counts = draws(model, draft, make_sampler(temp=WRONG_TEMPERATURE), FULL)
    assert chi_square_p(counts, expected) < THRESHOLD


def test_the_wrong_temperature_control_has_its_power(small_pair) -> None:
    # Sampling at WRONG_TEMPERATURE has plain sampling's joint there: the power is exact. FULL is
    # the least size with that power (to 50 keys), so that no test draws more than it needs.
    model, _ = small_pair
    expected, wrong = joint(model), joint(model, WRONG_TEMPERATURE)
    assert chi_square_power(expected, wrong, FULL) >= POWER
    assert chi_square_power(expected, wrong, FULL - 50) < POWER
