"""The loop's output has exactly the target's distribution when it samples (a draft model).

The first two tokens after :data:`helpers.PROMPT` are counted over fixed keys and compared with
the exact joint distribution of sampling the target alone (``tests/first_tokens.py``), on a
24-token llama with its first layer as draft, under both rules: coupled (the default) and
residual (rejection sampling). Negative controls (a wrong residual, positions sharing their
randomness, a wrong temperature) must fail at the same sample sizes.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from first_tokens import THRESHOLD, chi_square_p, exact_joint, sampled_pairs
from helpers import PROMPT
from tiny_models import cut, tiny_llama

from mlx_spec import rules
from mlx_spec.acceptance import accept_sampled
from mlx_spec.sampling import make_sampler

RULES = ["coupled", "residual"]

SMALL_VOCAB = 24


@pytest.fixture(scope="module")
def small_pair():
    model = tiny_llama(3, vocab=SMALL_VOCAB, head=4.0)
    return model, cut(model, 1)


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


@pytest.mark.parametrize("acceptance", RULES)
def test_first_two_tokens_have_the_target_distribution(small_pair, acceptance) -> None:
    model, draft = small_pair
    expected = joint(model)
    counts = draws(model, draft, make_sampler(temp=1.0), 1000, acceptance)
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
    counts = draws(model, draft, make_sampler(temp=1.0), 1000)
    assert chi_square_p(counts, expected) < THRESHOLD


def test_negative_control_resampling_from_the_target_fails(small_pair, monkeypatch) -> None:
    # A classic bug: after a rejection, drawing `next` from p instead of norm(max(p - q, 0)).
    model, draft = small_pair
    expected = joint(model)

    def without_residual(probs, tokens, draft_probs, eos, key, **options):
        result = accept_sampled(probs, tokens, draft_probs, eos, key, **options)
        row = mx.take(probs, result[0], axis=0)
        token = mx.random.categorical(mx.log(row), key=mx.random.split(key)[1])
        return mx.stack([result[0], token.astype(mx.uint32), result[2]])

    monkeypatch.setattr(rules, "sampled_decision", without_residual)
    counts = draws(model, draft, make_sampler(temp=1.0), 1000, "residual")
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
    counts = draws(model, draft, sampler, 3000, acceptance)
    assert chi_square_p(counts, expected) > THRESHOLD


@pytest.mark.statistical
@pytest.mark.parametrize("acceptance", RULES)
def test_first_two_tokens_with_an_unrelated_draft(small_pair, acceptance) -> None:
    model, _ = small_pair
    expected = joint(model)
    unrelated = tiny_llama(9, vocab=SMALL_VOCAB, head=4.0)
    counts = draws(model, unrelated, make_sampler(temp=1.0), 3000, acceptance)
    assert chi_square_p(counts, expected) > THRESHOLD


@pytest.mark.statistical
def test_negative_control_wrong_temperature_fails(small_pair) -> None:
    model, draft = small_pair
    expected = joint(model)
    counts = draws(model, draft, make_sampler(temp=1.1), 3000)
    assert chi_square_p(counts, expected) < THRESHOLD
