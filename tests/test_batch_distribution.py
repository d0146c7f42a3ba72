"""Each sampled sequence of a batch has exactly the target's distribution (``mlx_spec.batch``).

The first two tokens of :data:`helpers.PROMPT` are counted per sequence over fixed keys and
compared with the exact joint of sampling the target alone (``tests/first_tokens.py``), on the
24-token llama of ``tests/test_generation_sampled.py``. Every batch mixes what a batch may hold:
sampled sequences at different temperatures and filters, a greedy sequence, prompts of different
lengths (so rows are padded), and draft lengths that differ from row to row.

Sample sizes are those of ``tests/test_generation_sampled.py``, whose power calculations hold
here: the tested rows have the same model, prompt, draft and draft length, and the negative
controls inject the same bugs through the same code (:meth:`mlx_spec.rules.Rule.keys`, the
sampler's temperature).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import test_generation_sampled as alone
from first_tokens import THRESHOLD, WRONG_TEMPERATURE, chi_square_p
from helpers import PROMPT, ByteTokenizer
from mlx_lm.tokenizer_utils import TokenizerWrapper
from test_generation_sampled import COUPLED, FULL, SMALL_VOCAB, joint

import mlx_spec
from mlx_spec import rules

#: The 24-token llama and its first layer as draft, the pair the single-sequence tests use.
small_pair = alone.small_pair

#: A greedy row's prompt, shorter than PROMPT: the sampled rows are padded around it.
GREEDY_PROMPT = [7, 8, 9]


class _NoEos(ByteTokenizer):
    # An EOS outside the small vocabulary: every sequence runs its two tokens.
    eos_token_id = SMALL_VOCAB


@pytest.fixture(scope="module")
def tokenizer():
    return TokenizerWrapper(_NoEos())


def batch_pairs(
    model, tokenizer, samplers, samples, *, lengths, **drafting
) -> tuple[list[np.ndarray], list[list[int]]]:
    """``[V, V]`` counts of the first two tokens of each of ``samplers``' rows over ``samples``
    draws, and each greedy row's tokens of every draw.

    The draws are the sequences of one batch: ``samples`` groups of ``len(samplers)`` rows, row
    ``r`` of group ``i`` with ``samplers[r]``, ``lengths[r]`` draft tokens a round and key
    ``mx.random.key(i + r * samples)`` (no two rows share one). A sequence's text does not depend
    on its batch (``tests/test_batch.py``), so each is a draw of its own. Prompts are
    :data:`PROMPT`, and :data:`GREEDY_PROMPT` for a greedy row (``None`` sampler)."""
    rows = len(samplers)
    keys = [
        s and mx.random.key(i + r * samples) for i in range(samples) for r, s in enumerate(samplers)
    ]
    got = mlx_spec.batch_generate(
        model, tokenizer, [GREEDY_PROMPT if s is None else PROMPT for s in samplers] * samples,
        max_tokens=2, sampler=list(samplers) * samples, keys=keys,
        num_draft_tokens=list(lengths) * samples, return_token_ids=True, **drafting,
    )  # fmt: skip
    counts = [np.zeros((SMALL_VOCAB, SMALL_VOCAB), dtype=np.int64) for _ in samplers]
    greedy = []
    for k, (t1, t2) in enumerate(got.token_ids):
        counts[k % rows][t1, t2] += 1
        if samplers[k % rows] is None:
            greedy.append([t1, t2])
    return counts, greedy


def quick(model, draft, tokenizer):
    """A row at temperature 1 drafting 2 tokens beside a greedy row drafting none (the full tests
    mix temperatures and filters; rows of other temperatures cost time here, not power)."""
    samplers = [mlx_spec.make_sampler(temp=1.0), None]
    return batch_pairs(model, tokenizer, samplers, COUPLED, lengths=[2, 0], draft_model=draft)


def test_each_row_of_a_mixed_batch_has_the_target_distribution(small_pair, tokenizer):
    model, draft = small_pair
    (sampled, _), greedy = quick(model, draft, tokenizer)
    assert chi_square_p(sampled, joint(model)) > THRESHOLD
    assert all(tokens == greedy[0] for tokens in greedy)


def test_negative_control_positions_sharing_randomness_fails(small_pair, tokenizer, monkeypatch):
    # Every row of a round drawn with the round's first state, as in the single-sequence control
    # beside COUPLED: a kept draft token and the token after it come from one uniform.
    model, draft = small_pair
    original = rules.Rule.keys

    def shared(self, chain, position, n, *, draft):
        keys = original(self, chain, position, n, draft=draft)
        return mx.broadcast_to(keys[:1], keys.shape) if keys is not None else keys

    monkeypatch.setattr(rules.Rule, "keys", shared)
    (sampled, _), _ = quick(model, draft, tokenizer)
    assert chi_square_p(sampled, joint(model)) < THRESHOLD


FILTERED = [
    (0.7, {}),
    (1.0, {"top_p": 0.8}),
    None,
    (1.0, {"top_k": 5}),
    (0.8, {"top_p": 0.9, "min_p": 0.05, "top_k": 8}),
]


@pytest.mark.statistical
@pytest.mark.parametrize("drafter", ["prompt-lookup", "draft-model"])
def test_rows_with_filters_have_their_own_distribution(small_pair, tokenizer, drafter):
    model, draft = small_pair
    drafting = {"drafter": drafter} if drafter == "prompt-lookup" else {"draft_model": draft}
    samplers = [None if f is None else mlx_spec.make_sampler(temp=f[0], **f[1]) for f in FILTERED]
    counts, greedy = batch_pairs(
        model, tokenizer, samplers, FULL, lengths=[2, 1, 0, 2, 1], **drafting
    )
    for row, f in zip(counts, FILTERED, strict=True):
        if f is not None:
            assert chi_square_p(row, joint(model, f[0], **f[1])) > THRESHOLD, f
    assert all(tokens == greedy[0] for tokens in greedy)


@pytest.mark.statistical
def test_negative_control_wrong_temperature_fails(small_pair, tokenizer):
    # Its power at FULL is exact (test_generation_sampled.py checks it).
    model, draft = small_pair
    counts, _ = batch_pairs(
        model, tokenizer, [mlx_spec.make_sampler(temp=WRONG_TEMPERATURE), None], FULL,
        lengths=[2, 1], draft_model=draft,
    )  # fmt: skip
    assert chi_square_p(counts[0], joint(model)) < THRESHOLD
