"""Batched speculative decoding (``mlx_spec.batch``) against mlx-lm's own batched generation.

At temperature 0 every sequence's tokens must be those mlx-lm's ``batch_generate`` gives the same
prompts in the same batch, whatever the drafter, the draft lengths, or where a sequence ends. A
sampled sequence's tokens must be those single-sequence generation gives it alone with the same
sampler and key (``tests/test_batch_distribution.py`` tests their distribution).
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from helpers import ByteTokenizer, run
from mlx_lm.generate import BatchGenerator, generate_step
from mlx_lm.models.cache import (
    ArraysCache,
    BatchKVCache,
    KVCache,
    RotatingKVCache,
    make_prompt_cache,
)
from mlx_lm.tokenizer_utils import TokenizerWrapper
from tiny_models import cut, tiny_llama, tiny_qwen2, tiny_qwen3_5

import mlx_spec
from mlx_spec import _mlx_lm
from mlx_spec.batch_length import BatchAdaptive
from mlx_spec.drafters import Draft, PromptLookupDrafter
from mlx_spec.generation import speculative_generate_step
from mlx_spec.keys import seed_of

# Very different lengths: a repeated phrase (prompt lookup finds it), a single token, a short
# repetition and a long one.
PROMPTS = [[1, 2, 3, 4, 5] * 8, [7], [9, 10, 11, 9, 10, 11, 9, 10], [3, 4, 8] * 25]


@pytest.fixture(scope="module")
def tokenizer():
    return TokenizerWrapper(ByteTokenizer())


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3_5"])
def pair(request):
    """A target and a draft of it: its first layer alone, or a hybrid's first two (a gated
    delta-net layer and an attention layer)."""
    if request.param == "qwen3_5":
        model = tiny_qwen3_5(0)
        return model, cut(model, 2)
    model = tiny_llama(0) if request.param == "llama" else tiny_qwen2(3)
    return model, cut(model, 1)


def assert_same_caches(got, want):
    """Two lists of single-sequence caches hold the same tokens: attention layers the same keys
    and values, recurrent layers (``ArraysCache``) the same states."""
    assert [type(c) for c in got] == [type(c) for c in want]
    for a, b in zip(got, want, strict=True):
        if isinstance(a, ArraysCache):
            pairs = list(zip(a.cache, b.cache, strict=True))
        else:
            assert a.offset == b.offset
            pairs = [(x[..., : a.offset, :], y[..., : b.offset, :])
                     for x, y in ((a.keys, b.keys), (a.values, b.values))]  # fmt: skip
        for x, y in pairs:
            np.testing.assert_allclose(np.array(x), np.array(y), atol=1e-4)


def plain(model, tokenizer, prompts, max_tokens, **kwargs):
    """mlx-lm's own batched generation, without speculation."""
    response = mlx_lm.batch_generate(
        model, tokenizer, prompts, max_tokens=max_tokens, return_token_ids=True, **kwargs
    )
    return response.token_ids


def speculative(model, tokenizer, prompts, max_tokens, **kwargs):
    return mlx_spec.batch_generate(
        model, tokenizer, prompts, max_tokens=max_tokens, return_token_ids=True, **kwargs
    )


@pytest.mark.parametrize("drafter", ["prompt-lookup", "draft-model"])
def test_every_sequence_is_mlx_lms_batched_greedy_output(pair, tokenizer, drafter):
    model, draft = pair
    kwargs = {"drafter": drafter} if drafter == "prompt-lookup" else {"draft_model": draft}
    want = plain(model, tokenizer, PROMPTS, 40)
    got = speculative(model, tokenizer, PROMPTS, 40, num_draft_tokens=4, **kwargs)
    assert got.token_ids == want
    assert got.texts == [tokenizer.decode(t) for t in want]


def test_per_sequence_draft_lengths_including_zero(pair, tokenizer):
    model, draft = pair
    max_tokens = [30, 12, 25, 30]
    want = plain(model, tokenizer, PROMPTS, max_tokens)
    for kwargs in ({"draft_model": draft}, {"drafter": mlx_spec.PromptLookupDrafter(2)}):
        got = speculative(
            model, tokenizer, PROMPTS, max_tokens, num_draft_tokens=[3, 0, 5, 1], **kwargs
        )
        assert got.token_ids == want, kwargs


def test_a_draft_equal_to_the_target_keeps_every_draft_token(tokenizer):
    """Rounds are counted: a draft the target always agrees with emits ``N + 1`` a round."""
    model = tiny_llama(0)
    n, max_tokens = 3, 22
    got = speculative(
        model, tokenizer, PROMPTS, max_tokens, draft_model=model, num_draft_tokens=n,
        adaptive=False,
    )  # fmt: skip
    assert got.token_ids == plain(model, tokenizer, PROMPTS, max_tokens)
    assert got.stats.generation_steps == math.ceil(max_tokens / (n + 1))


def test_no_draft_is_one_token_a_round(tokenizer):
    model = tiny_llama(0)
    got = speculative(model, tokenizer, PROMPTS, 9, drafter="prompt-lookup", num_draft_tokens=0)
    assert got.token_ids == plain(model, tokenizer, PROMPTS, 9)
    assert got.stats.generation_steps == 9


# Drafting cannot pay: a round costs ten plain steps, and each draft token ten more.
DEAR = mlx_spec.Calibration(plain=1.0, round=10.0, token=10.0)
# Drafting pays: a round costs a plain step, whatever it drafts.
CHEAP = mlx_spec.Calibration(plain=1.0, round=1.0, token=0.0)


@pytest.mark.parametrize("drafter", ["prompt-lookup", "draft-model"])
def test_adaptive_lengths_draft_nothing_where_drafting_cannot_pay(tokenizer, drafter):
    """The draft model is the target itself, so any round would keep its drafts and emit more
    than one token; a batch that never drafts takes one step a token."""
    model = tiny_llama(0)
    kwargs = {"drafter": drafter} if drafter == "prompt-lookup" else {"draft_model": model}
    policy = BatchAdaptive(4, {b: DEAR for b in range(1, 5)})
    got = speculative(model, tokenizer, PROMPTS, 20, policy=policy, **kwargs)
    assert got.token_ids == plain(model, tokenizer, PROMPTS, 20)
    assert got.stats.generation_steps == 20


def test_adaptive_lengths_draft_the_most_where_drafting_pays(tokenizer):
    model = tiny_llama(0)
    policy = BatchAdaptive(3, {b: CHEAP for b in range(1, 5)})
    got = speculative(model, tokenizer, PROMPTS, 22, draft_model=model, policy=policy)
    assert got.token_ids == plain(model, tokenizer, PROMPTS, 22)
    assert got.stats.generation_steps == math.ceil(22 / 4)


def test_adaptive_lengths_follow_the_batch_size(tokenizer):
    """Drafting pays for one row, not for four: plain steps while four rows run, then rounds of
    4 tokens for the last row once the three others have finished (after the plain step
    already started when they did: 7 plain steps, then 19 tokens in rounds of 4)."""
    model = tiny_llama(0)
    max_tokens = [6, 6, 6, 26]
    policy = BatchAdaptive(3, {1: CHEAP, 4: DEAR})
    got = speculative(model, tokenizer, PROMPTS, max_tokens, draft_model=model, policy=policy)
    assert got.token_ids == plain(model, tokenizer, PROMPTS, max_tokens)
    assert got.stats.generation_steps == 7 + math.ceil(19 / 4)


def test_an_adaptive_policy_measures_the_batch_size_it_runs_at(pair, tokenizer):
    model, draft = pair
    policy = BatchAdaptive(3)
    # Three prompts none of the models ends early: the batch stays at three rows.
    prompts = PROMPTS[:3]
    got = speculative(model, tokenizer, prompts, 40, draft_model=draft, policy=policy)
    assert got.token_ids == plain(model, tokenizer, prompts, 40)
    assert [len(t) for t in got.token_ids] == [40] * 3
    assert list(policy.calibrations) == [3]


def test_eos_inside_a_draft_ends_only_its_sequence():
    """The EOS id is a token sequence 0 emits at a position its round drafts (the draft is the
    target itself, so every draft token is kept and rounds emit ``N + 1`` tokens)."""
    model, n = tiny_llama(0), 3
    free = plain(model, TokenizerWrapper(ByteTokenizer()), PROMPTS, 24)[0]
    # Generated position k is drafted when it is not the last of its round's N + 1 tokens.
    k = next(k for k, t in enumerate(free) if k >= 4 and k % (n + 1) != n and t not in free[:k])
    eos = TokenizerWrapper(ByteTokenizer(), eos_token_ids=[free[k]])
    want = plain(model, eos, PROMPTS, 24)
    assert want[0] == free[:k]
    got = speculative(
        model, eos, PROMPTS, 24, draft_model=model, num_draft_tokens=n, adaptive=False
    )
    assert got.token_ids == want


@pytest.mark.parametrize("lengths", ["adaptive", "fixed", "plain steps"])
def test_prompt_caches_hold_the_prompt_and_every_token(pair, tokenizer, lengths):
    """Rows end at different steps: after a round, or a plain step with the next one started."""
    model, draft = pair
    max_tokens = [15, 9, 12, 15]
    chosen = {
        "adaptive": {},
        "fixed": {"adaptive": False},
        "plain steps": {"policy": BatchAdaptive(3, {b: DEAR for b in range(1, 5)})},
    }[lengths]
    want = mlx_lm.batch_generate(
        model, tokenizer, PROMPTS, max_tokens=max_tokens, return_prompt_caches=True
    ).caches
    got = mlx_spec.batch_generate(
        model, tokenizer, PROMPTS, max_tokens=max_tokens, draft_model=draft,
        return_prompt_caches=True, **chosen,
    ).caches  # fmt: skip
    for mine, theirs in zip(got, want, strict=True):
        assert_same_caches(mine, theirs)


# A greedy sequence among sampled ones at three temperatures, with filters, and mlx-lm's own
# sampler, which exposes no distribution (drawn with mx.random's global state set per position).
SAMPLERS = [
    mlx_spec.make_sampler(temp=0.8),
    None,
    mlx_spec.make_sampler(temp=1.0, top_p=0.9, top_k=40),
    mlx_lm.sample_utils.make_sampler(temp=0.6, min_p=0.05),
]
KEYS = [mx.random.key(11), None, mx.random.key(12), mx.random.key(13)]


def alone(model, draft, drafter, prompt, sampler, key, max_tokens):
    """The tokens single-sequence speculative generation gives ``prompt`` with ``key``."""
    steps = speculative_generate_step(
        mx.array(prompt),
        model,
        draft,
        drafter=drafter,
        max_tokens=max_tokens,
        sampler=sampler,
        key=key,
        num_draft_tokens=2,
    )
    return [token for token, _, _ in steps]


@pytest.mark.parametrize("drafter", ["prompt-lookup", "draft-model"])
def test_each_sampled_sequence_is_its_generation_alone_with_its_key(pair, tokenizer, drafter):
    model, draft = pair
    kwargs = {"drafter": drafter} if drafter == "prompt-lookup" else {"draft_model": draft}
    got = speculative(
        model, tokenizer, PROMPTS, 30, sampler=SAMPLERS, keys=KEYS,
        num_draft_tokens=[3, 2, 4, 1], **kwargs,
    )  # fmt: skip
    for i, (prompt, sampler, key) in enumerate(zip(PROMPTS, SAMPLERS, KEYS, strict=True)):
        single = alone(model, kwargs.get("draft_model"), kwargs.get("drafter"), prompt, sampler,
                       key, 30)  # fmt: skip
        # The batch ends a sequence at its EOS, which is not part of its text.
        eos = [k for k, token in enumerate(single) if token in tokenizer.eos_token_ids]
        assert got.token_ids[i] == single[: (eos or [len(single)])[0]], i


def test_sampled_rows_under_one_rule_are_their_generations_alone(pair, tokenizer):
    """One sampler for every row, so the batch's plain steps take the rows' keys from one table
    of the next positions' keys (SpeculativeBatch._step_keys): rows apart after rounds that kept
    different drafts, rows leaving, and stretches past the chain's blocks of 32 positions."""
    model, _ = pair
    sampler = mlx_spec.make_sampler(temp=1.0)
    keys = [mx.random.key(20 + i) for i in range(len(PROMPTS))]
    max_tokens = [70, 40, 55, 70]
    got = speculative(
        model, tokenizer, PROMPTS, max_tokens, sampler=sampler, keys=keys,
        drafter="prompt-lookup", num_draft_tokens=3,
    )  # fmt: skip
    assert got.stats.generation_steps < sum(max_tokens)  # rounds and plain steps
    for i, (prompt, key, most) in enumerate(zip(PROMPTS, keys, max_tokens, strict=True)):
        single = alone(model, None, "prompt-lookup", prompt, sampler, key, most)
        eos = [k for k, token in enumerate(single) if token in tokenizer.eos_token_ids]
        assert got.token_ids[i] == single[: (eos or [len(single)])[0]], i


@pytest.mark.parametrize("lengths", ["plain steps", "fixed"])
def test_each_response_carries_its_own_positions_logprobs(lengths):
    """Every response's ``[V]`` log-probabilities, from plain steps (rows sliced from a
    ``[B, V]`` step) or rounds (from a ``[B, N + 1, V]`` one), are those that plain decoding of
    its row alone gives at that position."""
    from mlx_spec.batch import SpeculativeBatch

    model = tiny_llama(0)
    max_tokens = [12, 7, 10, 12]
    # Plain steps: drafting priced out. Rounds: the model drafts for itself, every draft kept.
    drafting = (
        {
            "drafter": PromptLookupDrafter(),
            "policy": BatchAdaptive(3, {b: DEAR for b in range(1, 5)}),
        }
        if lengths == "plain steps"
        else {"draft_model": model}
    )
    batch = SpeculativeBatch(
        model, PROMPTS, [3] * 4, max_tokens, [], [None] * 4, [None] * 4, **drafting
    )
    got: dict[int, list[np.ndarray]] = {uid: [] for uid in range(4)}
    calls = 0
    while len(batch):
        calls += 1
        for response in batch.next():
            got[response.uid].append(np.array(response.logprobs))
    assert calls == (max(max_tokens) if lengths == "plain steps" else 3)
    for uid, prompt in enumerate(PROMPTS):
        steps = generate_step(mx.array(prompt), model, max_tokens=max_tokens[uid])
        want = [np.array(logprobs) for _, logprobs in steps]
        assert len(got[uid]) == len(want), uid
        for mine, theirs in zip(got[uid], want, strict=True):
            np.testing.assert_allclose(mine, theirs, atol=1e-4)


def test_a_sequence_drafting_more_or_less_draws_the_same_text(tokenizer):
    """The same prompt and key twice in one batch, drafting 0 and 5 tokens a round (the draft
    model is the target itself, so the drafting row keeps many): one text."""
    model = tiny_llama(0)
    sampler = mlx_spec.make_sampler(temp=1.0)
    got = speculative(
        model, tokenizer, [PROMPTS[0]] * 2, 24, draft_model=model, num_draft_tokens=[0, 5],
        sampler=sampler, keys=[mx.random.key(3)] * 2, adaptive=False,
    )  # fmt: skip
    assert got.token_ids[0] == got.token_ids[1]
    assert got.stats.generation_steps == 24  # the row that drafts none sets the pace


def test_default_keys_come_from_the_global_seed(tokenizer):
    model = tiny_llama(0)
    sampler = mlx_spec.make_sampler(temp=1.0)

    def run():
        mx.random.seed(5)
        return speculative(
            model, tokenizer, [PROMPTS[1]] * 2, 12, drafter="prompt-lookup", sampler=sampler
        ).token_ids

    first = run()
    assert run() == first
    assert first[0] != first[1]  # each sequence its own key


def test_given_keys_leave_the_global_state_as_it_was(tokenizer):
    """mlx-lm's sampler is called with the global state set to each position's; it is put back."""
    model = tiny_llama(0)
    mx.random.seed(9)
    before = seed_of(mx.random.state[0])
    speculative(
        model, tokenizer, PROMPTS[:2], 8, drafter="prompt-lookup", sampler=SAMPLERS[3],
        keys=KEYS[2:],
    )  # fmt: skip
    assert seed_of(mx.random.state[0]) == before


def _filled(lengths: list[int], fed: int) -> BatchKVCache:
    """A batch cache whose row ``i`` holds ``lengths[i]`` values ``100 i + j``, then ``fed``
    columns fed to every row (``100 i + lengths[i] + j``)."""
    longest = max(lengths)
    layer = BatchKVCache([longest - n for n in lengths])
    values = [
        [0.0] * (longest - n) + [100.0 * i + j for j in range(n)] for i, n in enumerate(lengths)
    ]
    layer.update_and_fetch(*[mx.array(values).reshape(len(lengths), 1, longest, 1)] * 2)
    after = [[100.0 * i + n + j for j in range(fed)] for i, n in enumerate(lengths)]
    layer.update_and_fetch(*[mx.array(after).reshape(len(lengths), 1, fed, 1)] * 2)
    return layer


@pytest.mark.parametrize("keep", [_mlx_lm._kept_in_place, _mlx_lm._kept_by_rows])
def test_each_batch_cache_row_keeps_its_own_length(keep):
    lengths, fed, kept = [5, 1, 3], 4, [1, 4, 0]
    layer = keep(_filled(lengths, fed), fed, kept)
    for i, (n, k) in enumerate(zip(lengths, kept, strict=True)):
        row = layer.extract(i)
        assert row.keys[0, 0, :, 0].tolist() == [100.0 * i + j for j in range(n + k)]
    # The next column lands right after each row's kept values.
    layer.update_and_fetch(*[mx.full((3, 1, 1, 1), -1.0)] * 2)
    assert [layer.extract(i).keys[0, 0, -2:, 0].tolist()[-1] for i in range(3)] == [-1.0] * 3
    assert layer.offset.tolist() == [n + k + 1 for n, k in zip(lengths, kept, strict=True)]


def test_the_in_place_probe_holds_on_this_mlx_lm():
    assert _mlx_lm.batch_rows_kept()
    assert _mlx_lm.report()["batch cache rows taken back in place"]


@pytest.mark.parametrize("broken", [None, "trimmed", "out of order"])
def test_the_window_probe_holds_and_fails_on_a_window_taken_back_wrong(broken, monkeypatch):
    # mlx-lm's own trim leaves rejected entries in the buffer and rows unshifted; a rotated
    # buffer left as it is before a call of several positions hides a short row's oldest token.
    if broken == "trimmed":
        monkeypatch.setattr(
            _mlx_lm, "_window_kept", lambda layer, fed, kept: layer.trim(fed - max(kept))
        )
    if broken == "out of order":
        monkeypatch.setattr(_mlx_lm, "windows_in_order", lambda layers: None)
    monkeypatch.setattr(_mlx_lm, "_warned", set())
    _mlx_lm.batch_windows_kept.cache_clear()
    try:
        if broken is None:
            assert _mlx_lm.batch_windows_kept()
        else:
            with pytest.warns(RuntimeWarning, match="batch of sliding windows"):
                assert not _mlx_lm.batch_windows_kept()
    finally:
        _mlx_lm.batch_windows_kept.cache_clear()


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
@pytest.mark.parametrize("width", [2, 37, 4096, 151936])
def test_a_batchs_rows_drawn_in_one_graph_are_mlx_s_categorical_draws(dtype, width):
    # 24 rows a case (12 with a third of their tokens masked, half of them rounded to ties),
    # each against mx.random.categorical of that row alone with its key: every token equal.
    count = 24
    rows = 5 * mx.random.normal((count, width), key=mx.random.key(width))
    masked = mx.random.uniform(shape=(count, width), key=mx.random.key(width + 1)) < 0.33
    rows = mx.where(mx.arange(count)[:, None] % 2 == 1, mx.where(masked, -mx.inf, rows), rows)
    rows = mx.where(mx.arange(count)[:, None] % 4 == 3, mx.round(rows), rows).astype(dtype)
    rows = rows - mx.logsumexp(rows, axis=-1, keepdims=True)
    keys = mx.stack([mx.random.key(7 * width + i) for i in range(count)])
    alone = [mx.random.categorical(rows[i : i + 1], key=keys[i]) for i in range(count)]
    assert _mlx_lm.categorical_rows(rows, keys).tolist() == mx.concatenate(alone).tolist()


def test_the_one_graph_probe_holds_leaves_the_global_state_and_fails_on_other_draws(monkeypatch):
    state = mx.random.state[0].tolist()
    _mlx_lm.rows_by_inverse_cdf.cache_clear()
    try:
        assert _mlx_lm.rows_by_inverse_cdf() and mx.random.state[0].tolist() == state

        # A categorical drawing otherwise (the Gumbel-max draw of earlier MLX versions): the
        # probe fails, warns, and rows are drawn one call each.
        def gumbel_max(logits, key):
            noise = mx.random.gumbel(shape=logits.shape, key=key)
            return mx.argmax(logits.astype(mx.float32) + noise, axis=-1)

        monkeypatch.setattr(mx.random, "categorical", gumbel_max)
        monkeypatch.setattr(_mlx_lm, "_warned", set())
        _mlx_lm.rows_by_inverse_cdf.cache_clear()
        with pytest.warns(RuntimeWarning, match="drawing a batch's rows in one graph"):
            assert not _mlx_lm.rows_by_inverse_cdf()
    finally:
        monkeypatch.undo()
        _mlx_lm.rows_by_inverse_cdf.cache_clear()


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"prompts": []}, "`prompts`"),
        ({"prompts": [[1, 2], []]}, "`prompts[1]`"),
        ({"prompts": [[1, 300]]}, "`prompts[0]`"),
        ({"drafter": None}, "`draft_model` and `drafter`"),
        ({"drafter": "lookup"}, "`drafter`"),
        ({"num_draft_tokens": -1}, "`num_draft_tokens`"),
        ({"num_draft_tokens": [1, 2, 3]}, "`num_draft_tokens`"),
        ({"max_tokens": 0}, "`max_tokens`"),
        ({"sampler": [None]}, "`sampler`"),
        ({"sampler": [None, 3]}, "`sampler[1]`"),
        ({"sampler": SAMPLERS[0], "keys": [mx.random.key(1)]}, "`keys`"),
        ({"sampler": SAMPLERS[:2], "keys": [None, None]}, "`keys[0]`"),
        ({"sampler": SAMPLERS[0], "keys": [mx.random.key(1), mx.array([1, 2])]}, "`keys[1]`"),
        ({"acceptance": "residual"}, "`acceptance`"),
        ({"logits_processors": [None]}, "`logits_processors`"),
        ({"completion_batch_size": 0}, "`completion_batch_size`"),
        ({"prefill_step_size": 0}, "`prefill_step_size`"),
        ({"return_token_ids": 1}, "`return_token_ids`"),
        ({"adaptive": 1}, "`adaptive`"),
        ({"policy": mlx_spec.Calibration(1.0, 1.0, 1.0)}, "`policy`"),
        ({"policy": BatchAdaptive(2), "adaptive": False}, "`policy`"),
    ],
)
def test_bad_arguments_are_refused_before_any_work(tokenizer, kwargs, named):
    model = tiny_llama(0)
    arguments = {"prompts": [[1, 2], [3]], "drafter": "prompt-lookup", **kwargs}
    with pytest.raises(ValueError, match=r"mlx_spec\.batch_generate") as error:
        mlx_spec.batch_generate(model, tokenizer, **arguments)
    assert named in str(error.value)


def test_models_whose_caches_do_not_batch_are_refused(tokenizer):
    from tiny_models import tiny_gemma3, tiny_lfm2

    # A draft model with sliding windows (a target may have them).
    with pytest.raises(ValueError, match=r"`draft_model` has sliding windows"):
        mlx_spec.batch_generate(tiny_llama(0), tokenizer, [[1, 2]], draft_model=tiny_gemma3(0))
    # LFM2's short convolutions keep a state mlx-spec does not track after each position.
    with pytest.raises(ValueError, match=r"`draft_model` has recurrent layers whose states"):
        mlx_spec.batch_generate(tiny_llama(0), tokenizer, [[1, 2]], draft_model=tiny_lfm2(0))
    # A window that keeps its first tokens (mlx-lm's max_kv_size): no batch cache holds one.
    keeping = tiny_gemma3(0)
    keeping.make_cache = lambda: [RotatingKVCache(8, keep=4), KVCache()] * 2
    with pytest.raises(ValueError, match=r"`model` has caches of .*RotatingKVCache"):
        mlx_spec.batch_generate(keeping, tokenizer, [[1, 2]], drafter="prompt-lookup")


class Foreseeing(PromptLookupDrafter):
    """Proposes the target's own tokens for the sequence (``references``, by prompt), wrong at
    every third generated position: most drafts are kept, and rows keep different counts."""

    def __init__(self, references: dict[tuple[int, ...], list[int]], vocab: int) -> None:
        super().__init__()
        self.references = references
        self.vocab = vocab
        self.prompt: tuple[int, ...] = ()

    def start(self, text, setup) -> None:
        super().start(text, setup)
        self.prompt = tuple(text.ids(0))

    def propose(self, text, n, keys) -> Draft:
        done = len(text) - len(self.prompt)
        ahead = self.references[self.prompt][done : done + n]
        wrong = [(done + j) % 3 == 2 for j in range(len(ahead))]
        tokens = [(t + 1) % self.vocab if w else t for t, w in zip(ahead, wrong, strict=True)]
        return Draft(mx.array(tokens, dtype=mx.uint32))


@pytest.mark.parametrize("window", [4, 8])
@pytest.mark.parametrize("lengths", ["fixed", "adaptive"])
def test_sliding_windows_give_mlx_lms_batched_tokens(tokenizer, window, lengths):
    # Windows of 4 and 8 tokens, passed many times over; drafts of the target's own tokens,
    # two of three kept, so that rows keep different counts in most rounds; and prompt lookup.
    from tiny_models import tiny_gemma3

    model = tiny_gemma3(0, window=window)
    want = plain(model, tokenizer, PROMPTS, 48)
    references = {tuple(p): t + [0] * 16 for p, t in zip(PROMPTS, want, strict=True)}
    chosen = {"fixed": {"adaptive": False}, "adaptive": {}}[lengths]
    for drafter in (Foreseeing(references, 256), "prompt-lookup"):
        got = speculative(
            model, tokenizer, PROMPTS, 48, drafter=drafter, num_draft_tokens=4, **chosen
        )
        assert got.token_ids == want
    # With the foreseeing drafter at fixed N, rounds emitted more than one token on average.
    if lengths == "fixed":
        got = speculative(model, tokenizer, PROMPTS, 48, drafter=Foreseeing(references, 256),
                          num_draft_tokens=4, adaptive=False)  # fmt: skip
        assert got.stats.generation_steps < 30


def drive(insert, remove, step, max_tokens):
    """Runs a batch generator through one join and leave schedule: A and B at once; C, the
    longest prompt, joins once A has 4 tokens; D, a single token, once C has one; B leaves once
    it has 6, with its caches. Returns each sequence's tokens and B's ``(caches, tokens)``."""
    names = dict(zip(insert([PROMPTS[0], PROMPTS[2]], max_tokens[:2]), "AB", strict=True))
    out = {name: [] for name in "ABCD"}
    left = None
    for _ in range(400):
        responses = step()
        for r in responses:
            out[names[r.uid]].append(r.token)
        if "C" not in names.values() and len(out["A"]) >= 4:
            names[insert([PROMPTS[3]], max_tokens[2:3])[0]] = "C"
        if "D" not in names.values() and out["C"]:
            names[insert([PROMPTS[1]], max_tokens[3:])[0]] = "D"
        if left is None and len(out["B"]) >= 6:
            b = next(uid for uid, name in names.items() if name == "B")
            left = remove([b], return_prompt_caches=True)[b]
        if not responses and "D" in names.values():
            return out, left
    raise AssertionError("the schedule did not end")


@pytest.mark.parametrize("drafter", ["prompt-lookup", "draft-model"])
@pytest.mark.parametrize(
    ("target", "lengths"),
    [
        ("llama", "adaptive"),
        ("llama", "fixed"),
        ("llama", "plain steps"),
        ("qwen3_5", "fixed"),
        ("gemma3", "fixed"),
    ],
)
def test_sequences_join_and_leave_as_in_mlx_lms_batch_generator(
    tokenizer, drafter, target, lengths
):
    from tiny_models import tiny_gemma3

    models = {"llama": tiny_llama, "qwen3_5": tiny_qwen3_5, "gemma3": tiny_gemma3}
    model = models[target](0)
    max_tokens = [24, 40, 18, 20]
    eos = list(tokenizer.eos_token_ids)
    theirs = BatchGenerator(model, stop_tokens=[[t] for t in eos])
    want, _ = drive(theirs.insert, theirs.remove, theirs.next_generated, max_tokens)
    theirs.close()
    chosen = {
        "adaptive": {},
        "fixed": {"adaptive": False},
        "plain steps": {"policy": BatchAdaptive(3, {b: DEAR for b in range(1, 5)})},
    }[lengths]
    # A hybrid's draft is its first two layers (one of each kind); a windowed target's, a
    # transformer (a batched draft model has no windows).
    drafts = {"llama": lambda: cut(model, 1), "qwen3_5": lambda: cut(model, 2),
              "gemma3": lambda: tiny_llama(0)}  # fmt: skip
    draft = drafts[target]() if drafter == "draft-model" else None
    drafting = {"drafter": drafter} if draft is None else {"draft_model": draft}
    mine = mlx_spec.SpeculativeBatchGenerator(model, eos_token_ids=eos, **drafting, **chosen)
    got, (caches, held) = drive(mine.insert, mine.remove, mine.next, max_tokens)
    assert [got[k] for k in "ACD"] == [want[k] for k in "ACD"]
    # B left after at least 6 tokens, which a round may pass: a prefix of its whole output.
    whole = plain(model, tokenizer, [PROMPTS[2]], max_tokens[1])[0]
    assert len(got["B"]) >= 6 and got["B"] == whole[: len(got["B"])]
    assert held == PROMPTS[2] + got["B"]
    # The target's caches, then the draft model's.
    fresh = []
    for each in (model, draft) if draft is not None else (model,):
        own = make_prompt_cache(each)
        each(mx.array([held]), cache=own)
        fresh += own
    assert {c.offset for c in caches if not isinstance(c, ArraysCache)} == {len(held)}
    if target != "gemma3":
        assert_same_caches(caches, fresh)
    # Each model's next logits from them are those from caches of its tokens fed afresh (a
    # window's buffer may hold older entries than a fresh one's).
    first = 0
    for each in (model, draft) if draft is not None else (model,):
        layers = len(make_prompt_cache(each))
        x = mx.array([[7]])
        ours = each(x, cache=caches[first : first + layers])
        theirs = each(x, cache=fresh[first : first + layers])
        np.testing.assert_allclose(np.array(ours), np.array(theirs), atol=1e-4)
        first += layers


@pytest.mark.parametrize(
    ("make", "named"),
    [
        (lambda m: mlx_spec.SpeculativeBatchGenerator(m, drafter="lookup"), "`drafter`"),
        (lambda m: mlx_spec.SpeculativeBatchGenerator(m), "`draft_model` and `drafter`"),
        (
            lambda m: mlx_spec.SpeculativeBatchGenerator(
                m, drafter="prompt-lookup", completion_batch_size=0
            ),
            "`completion_batch_size`",
        ),
        (
            lambda m: mlx_spec.SpeculativeBatchGenerator(
                m, drafter="prompt-lookup", policy=BatchAdaptive(2), adaptive=False
            ),
            "`policy`",
        ),
        (
            lambda m: mlx_spec.SpeculativeBatchGenerator(m, drafter="prompt-lookup").insert([]),
            "`prompts`",
        ),
        (
            lambda m: mlx_spec.SpeculativeBatchGenerator(m, drafter="prompt-lookup").insert(
                [[1], [2]], max_tokens=[3]
            ),
            "`max_tokens`",
        ),
    ],
)
def test_bad_generator_arguments_are_refused(make, named):
    with pytest.raises(ValueError, match=r"SpeculativeBatchGenerator") as error:
        make(tiny_llama(0))
    assert named in str(error.value)


def test_a_sequence_removed_before_it_joins_yields_nothing(tokenizer):
    model = tiny_llama(0)
    generator = mlx_spec.SpeculativeBatchGenerator(model, drafter="prompt-lookup")
    first, second = generator.insert([PROMPTS[0], PROMPTS[2]], max_tokens=8)
    caches, held = generator.remove([second], return_prompt_caches=True)[second]
    assert held == [] and all(layer.offset == 0 for layer in caches)
    tokens = []
    while len(generator):
        responses = generator.next()
        assert {r.uid for r in responses} <= {first}
        tokens += [r.token for r in responses]
    assert tokens == plain(model, tokenizer, [PROMPTS[0]], 8)[0]


def test_a_sequence_removed_while_it_is_prefilled_gives_the_caches_of_its_chunks(tokenizer):
    model = tiny_llama(0)
    generator = mlx_spec.SpeculativeBatchGenerator(
        model, drafter="prompt-lookup", prefill_step_size=16
    )
    first, second = generator.insert([PROMPTS[3], PROMPTS[0]], max_tokens=8)
    generator.next()
    generator.next()
    assert generator.prefilling == [first, second] and generator.prompt_cache_nbytes > 0
    caches, held = generator.remove([first], return_prompt_caches=True)[first]
    assert held == PROMPTS[3][:32] and {layer.offset for layer in caches} == {32}
    # The caches hold those tokens as a prefill of them alone does.
    alone = make_prompt_cache(model)
    model(mx.array([held]), cache=alone)
    for got, want in zip(caches, alone, strict=True):
        for ours, theirs in ((got.keys, want.keys), (got.values, want.values)):
            assert mx.allclose(ours[..., :32, :], theirs[..., :32, :], atol=1e-5).item()
    tokens = []
    while len(generator):
        tokens += [r.token for r in generator.next()]
    assert tokens == plain(model, tokenizer, [PROMPTS[0]], 8)[0]


@pytest.mark.parametrize("ends", [[0], [3, 2], [40], "3", [3, 3]])
def test_segment_ends_out_of_range_or_order_are_refused(ends):
    generator = mlx_spec.SpeculativeBatchGenerator(tiny_llama(0), drafter="prompt-lookup")
    with pytest.raises(ValueError, match=r"^SpeculativeBatchGenerator.insert: `segment_ends\[0\]`"):
        generator.insert([PROMPTS[0]], segment_ends=[ends])
    assert len(generator) == 0


@pytest.mark.parametrize("drafter", ["prompt-lookup", "draft-model"])
@pytest.mark.parametrize("lengths", ["fixed", "plain steps"])
def test_rows_with_logits_processors_give_mlx_lms_tokens(drafter, lengths):
    # Each row its own processors (a bias, a penalty, both, none), at fixed N = 3 (every
    # verified position processed given the drafts before it) and in plain steps (each given
    # the token of the step ahead of the text).
    from mlx_lm.sample_utils import make_logits_processors

    model = tiny_llama(0)
    processors = [
        make_logits_processors(repetition_penalty=1.5, repetition_context_size=20),
        [],
        make_logits_processors(logit_bias={200: -9.0, 7: 3.0}, repetition_penalty=1.2),
        make_logits_processors(logit_bias={33: 12.0}),
    ]
    theirs = BatchGenerator(model)
    uids = theirs.insert(PROMPTS, [20] * 4, logits_processors=processors)
    want = {uid: [] for uid in uids}
    while responses := theirs.next_generated():
        for r in responses:
            want[r.uid].append(r.token)
    theirs.close()
    chosen = {
        "fixed": {"adaptive": False},
        "plain steps": {"policy": BatchAdaptive(3, {b: DEAR for b in range(1, 5)})},
    }[lengths]
    draft = {"drafter": drafter} if drafter == "prompt-lookup" else {"draft_model": cut(model, 1)}
    mine = mlx_spec.SpeculativeBatchGenerator(model, **draft, **chosen)
    uids = mine.insert(PROMPTS, 20, logits_processors=processors)
    got = {uid: [] for uid in uids}
    while len(mine):
        for r in mine.next():
            got[r.uid].append(r.token)
    assert got == want


@pytest.mark.parametrize("drafter", ["prompt-lookup", "draft-model"])
def test_batch_generate_decodes_in_turns_under_completion_batch_size(
    tokenizer, drafter, monkeypatch
):
    # Four prompts, at most two decoding at once: the others join as sequences finish, and
    # every sequence gives its tokens of all four at once.
    model = tiny_llama(0)
    lookup = drafter == "prompt-lookup"
    drafting = {"drafter": drafter} if lookup else {"draft_model": cut(model, 1)}
    whole = mlx_spec.batch_generate(
        model, tokenizer, PROMPTS, max_tokens=12, return_token_ids=True, **drafting
    )
    most = []
    step = mlx_spec.SpeculativeBatchGenerator.next_with_prompts

    def counted(self):
        most.append(len(self.running))
        return step(self)

    monkeypatch.setattr(mlx_spec.SpeculativeBatchGenerator, "next_with_prompts", counted)
    turns = mlx_spec.batch_generate(
        model,
        tokenizer,
        PROMPTS,
        max_tokens=12,
        return_token_ids=True,
        completion_batch_size=2,
        **drafting,
    )
    assert turns.token_ids == whole.token_ids
    assert max(most) == 2 and len(most) > 12


@pytest.fixture(scope="module", params=["qwen3_5", "deepseek_v3"])
def mtp_model(request):
    """A tiny model with its MTP head attached (Qwen's layout, and DeepSeek's)."""
    from tiny_models import tiny_mtp_pair

    from mlx_spec.mtp import attach

    model, head = tiny_mtp_pair(request.param)
    attach(model, head)
    return model


@pytest.mark.parametrize("lengths", ["fixed", "adaptive"])
def test_mtp_heads_give_mlx_lms_batched_tokens(mtp_model, tokenizer, lengths):
    chosen = {"fixed": {"adaptive": False}, "adaptive": {}}[lengths]
    want = plain(mtp_model, tokenizer, PROMPTS, 30)
    got = speculative(mtp_model, tokenizer, PROMPTS, 30, drafter="mtp", num_draft_tokens=3,
                      **chosen)  # fmt: skip
    assert got.token_ids == want


def test_a_batch_of_one_drafts_what_its_head_drafts_alone(mtp_model, tokenizer):
    # The head sees each row's prompt, its rounds' kept positions and its plain steps as the
    # single-sequence MTP drafter sees them: the same drafts, so the same number of rounds
    # (prompts of one token excepted: the batch's pipelined plain steps start one step ahead).
    for prompt in (PROMPTS[0], PROMPTS[2], PROMPTS[3]):
        got = speculative(mtp_model, tokenizer, [prompt], 30, drafter="mtp", num_draft_tokens=3,
                          adaptive=False)  # fmt: skip
        tokens, flags, stats = run(
            prompt, mtp_model, None, drafter="mtp", num_draft_tokens=3, max_tokens=30,
            adaptive=False,
        )  # fmt: skip
        assert got.token_ids[0] == tokens
        assert sum(flags) >= 10  # the head's drafts are mostly kept
        assert got.stats.generation_steps == stats.rounds


def test_sampled_rows_with_a_head_are_their_generations_alone(mtp_model, tokenizer):
    got = speculative(mtp_model, tokenizer, PROMPTS, 24, drafter="mtp", sampler=SAMPLERS,
                      keys=KEYS, num_draft_tokens=[3, 2, 4, 1])  # fmt: skip
    for i, (prompt, sampler, key) in enumerate(zip(PROMPTS, SAMPLERS, KEYS, strict=True)):
        single = alone(mtp_model, None, "mtp", prompt, sampler, key, 24)
        eos = [k for k, token in enumerate(single) if token in tokenizer.eos_token_ids]
        assert got.token_ids[i] == single[: (eos or [len(single)])[0]], i


def test_a_generator_with_a_head_prefills_in_chunks_and_gives_mlx_lms_tokens(mtp_model, tokenizer):
    # Prompts prefilled 8 tokens a call (the head reads each chunk's hidden states), joining and
    # leaving as in test_sequences_join_and_leave_as_in_mlx_lms_batch_generator.
    max_tokens = [24, 40, 18, 20]
    eos = list(tokenizer.eos_token_ids)
    theirs = BatchGenerator(mtp_model, stop_tokens=[[t] for t in eos])
    want, _ = drive(theirs.insert, theirs.remove, theirs.next_generated, max_tokens)
    theirs.close()
    mine = mlx_spec.SpeculativeBatchGenerator(
        mtp_model, eos_token_ids=eos, drafter="mtp", adaptive=False, prefill_step_size=8
    )
    calls = []
    got, (caches, held) = drive(
        mine.insert, mine.remove, lambda: calls.append(mine.next()) or calls[-1], max_tokens
    )
    assert [got[k] for k in "ACD"] == [want[k] for k in "ACD"]
    assert held == PROMPTS[2] + got["B"]
    assert len(caches) == len(make_prompt_cache(mtp_model))  # the target's alone
    # Rounds emitted several tokens of one sequence: the head drafted what was kept.
    assert max(sum(r.uid == u for r in c) for c in calls for u in {r.uid for r in c}) >= 3


def test_a_model_without_a_usable_head_is_refused(tokenizer):
    from mlx_spec.mtp import attach, new_head

    with pytest.raises(ValueError, match=r"`drafter` is 'mtp', but `model` has no MTP head"):
        mlx_spec.batch_generate(tiny_llama(0), tokenizer, [[1, 2]], drafter="mtp")
    model = tiny_qwen3_5(0)
    attach(model, new_head(model, "qwen", layers=2))
    with pytest.raises(ValueError, match=r"a head of one layer, got 2"):
        mlx_spec.batch_generate(model, tokenizer, [[1, 2]], drafter="mtp")


def test_generator_stats_count_the_prefill_and_the_batch(tokenizer):
    # As mlx-lm's BatchGenerator.stats: the tokens prefilled (all of each prompt but its last,
    # which the first round feeds), the tokens emitted, the calls that ran the batch, and
    # times that add up to no more than the block's.
    model = tiny_llama(0)
    generator = mlx_spec.SpeculativeBatchGenerator(model, drafter="prompt-lookup")
    with generator.stats() as outer:
        generator.insert(PROMPTS[:2], max_tokens=10)
        with generator.stats() as first:
            first_responses = generator.next()
        emitted = len(first_responses)
        calls, with_tokens = 1, bool(first_responses)
        generator.insert(PROMPTS[2:], max_tokens=10)
        while len(generator):
            emitted += len(responses := generator.next())
            calls, with_tokens = calls + 1, with_tokens + bool(responses)
    assert first.prompt_tokens == len(PROMPTS[0]) + len(PROMPTS[1]) - 2
    # The one-token prompt joins at once: the first call also runs the batch.
    assert first.generation_steps == 1 and first.generation_tokens == len(first_responses)
    assert outer.prompt_tokens == sum(len(p) - 1 for p in PROMPTS)
    assert outer.generation_tokens == emitted == 40
    assert with_tokens <= outer.generation_steps <= calls
    assert 0 < outer.prompt_time + outer.decode_time <= outer.wall_time
    assert first.wall_time <= outer.wall_time and outer.peak_memory > 0
