"""The speculative generation loop against mlx-lm's plain generation, with tiny real llama models.

Models are ``mlx_lm.models.llama`` with fixed random float32 weights, built here (no downloads):
a target whose first layer dominates its second and whose output layer is scaled up, so its
distributions are peaked and its greedy text varied; drafts are the target itself, the target cut
to its first layer (agrees on about 3 of 4 tokens at temperature 0) and an unrelated random model
(almost never agrees).
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
import warnings

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from kernel_reference import reference_launch
from mlx.utils import tree_flatten, tree_map_with_path
from mlx_lm.generate import generate_step
from mlx_lm.models import llama
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache, trim_prompt_cache
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors
from scipy import stats as scipy_stats

import mlx_spec.generation as spec_generation
from mlx_spec import fused
from mlx_spec.acceptance import accept_sampled, read
from mlx_spec import rules
from mlx_spec.generation import (
    SpeculativeResponse,
    SpeculativeStats,
    speculative_generate_step,
    stream_generate,
)
from mlx_spec.patch import patch_mlx_lm, unpatch_mlx_lm
from mlx_spec.sampling import make_sampler

lm_generate = importlib.import_module("mlx_lm.generate")
lm_sample_utils = importlib.import_module("mlx_lm.sample_utils")

PROMPT = [1, 2, 3, 4, 5]


def tiny_llama(
    seed: int,
    *,
    vocab: int = 256,
    layers: int = 2,
    scales: tuple[float, ...] = (3.0, 1.5),
    head: float = 8.0,
) -> llama.Model:
    """A float32 llama with weights drawn from ``seed``; layer ``i``'s matrices scaled by
    ``scales[i]`` and the (untied) output layer by ``head``."""
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=layers,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=vocab,
        tie_word_embeddings=False,
    )
    mx.random.seed(seed)
    model = llama.Model(args)

    def scale(path: str, w: mx.array) -> mx.array:
        parts = path.split(".")
        if parts[:2] == ["model", "layers"] and "norm" not in path:
            return w * scales[int(parts[2])]
        return w * head if parts[0] == "lm_head" else w

    model.update(tree_map_with_path(scale, model.parameters()))
    mx.eval(model.parameters())
    return model


def truncated(model: llama.Model, layers: int) -> llama.Model:
    """``model`` keeping its first ``layers`` layers, embeddings and output layer."""
    args = dataclasses.replace(model.args, num_hidden_layers=layers, layer_types=None)
    cut = llama.Model(args)
    weights = [
        (k, v)
        for k, v in tree_flatten(model.parameters())
        if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers
    ]
    cut.load_weights(weights)
    mx.eval(cut.parameters())
    return cut


class ByteTokenizer:
    """The least a tokenizer needs for mlx-lm's ``TokenizerWrapper``: token ``i`` is a letter."""

    eos_token_id = 0
    bos_token = None
    chat_template = None

    def get_vocab(self) -> dict[str, int]:
        return {}

    def apply_chat_template(self, *args, **kwargs):
        raise NotImplementedError

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [1 + ord(c) % 200 for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids if i != 0)


@pytest.fixture(scope="module")
def target() -> llama.Model:
    return tiny_llama(0)


@pytest.fixture(scope="module")
def drafts(target: llama.Model) -> dict[str, llama.Model]:
    return {"self": target, "truncated": truncated(target, 1), "unrelated": tiny_llama(7)}


@pytest.fixture(scope="module")
def greedy_reference(target: llama.Model) -> list[int]:
    """300 tokens of mlx-lm's plain greedy ``generate_step``."""
    return [t for t, _ in generate_step(mx.array(PROMPT), target, max_tokens=300)]


def run(prompt, model, draft, **kwargs) -> tuple[list[int], list[bool], SpeculativeStats]:
    stats = SpeculativeStats()
    tokens, flags = [], []
    for token, _, from_draft in speculative_generate_step(
        mx.array(prompt), model, draft, stats=stats, **kwargs
    ):
        tokens.append(token)
        flags.append(from_draft)
    return tokens, flags, stats


# --- temperature 0: equal to plain greedy generation -----------------------------------------


def test_reference_text_is_varied(greedy_reference: list[int]) -> None:
    # Guards the tests below: a model stuck on one token would make them vacuous.
    assert len(set(greedy_reference)) > 50


@pytest.mark.parametrize("n", [1, 3, 8])
@pytest.mark.parametrize("kind", ["self", "truncated", "unrelated"])
def test_greedy_equals_plain_generate_step(target, drafts, greedy_reference, kind, n) -> None:
    # 203 tokens: with the target as its own draft and N = 8 (9 tokens a round), 5 tokens are
    # left for the last round, which drafts only the 4 that can be used. A round drafts N tokens
    # unless fewer than N + 1 are left, which happens in at most the last N rounds.
    tokens, flags, stats = run(PROMPT, target, drafts[kind], num_draft_tokens=n, max_tokens=203)
    assert tokens == greedy_reference[:203]
    assert stats.generated == 203
    assert n * (stats.rounds - n) <= stats.drafted <= n * stats.rounds
    # One target token a round: no round drafts past what is left to generate.
    assert flags.count(False) == stats.rounds
    assert sum(flags) <= stats.accepted
    if kind == "self":
        assert stats.accepted == stats.drafted
    if kind == "unrelated":
        assert stats.acceptance_rate < 0.2
    if kind == "truncated":
        assert 0.3 < stats.acceptance_rate < 0.95


@pytest.mark.parametrize("n", [1, 3, 8])
@pytest.mark.parametrize("kind", ["self", "truncated", "unrelated"])
def test_greedy_stops_at_first_eos_of_any_id(target, drafts, greedy_reference, kind, n) -> None:
    # Two EOS ids: the earlier of their first occurrences ends the generation.
    first = {t: i for i, t in reversed(list(enumerate(greedy_reference)))}
    late, early = greedy_reference[150], greedy_reference[60]
    stop = min(first[late], first[early])
    assert stop > 20
    tokens, flags, _ = run(
        PROMPT,
        target,
        drafts[kind],
        num_draft_tokens=n,
        max_tokens=300,
        eos_token_ids=[late, early],
    )
    assert tokens == greedy_reference[: stop + 1]
    if kind == "self" and n == 8:
        # The EOS was a draft token accepted mid-round: the round was cut right after it.
        assert flags[-1]


def test_max_tokens_is_exact_for_every_length(target, drafts, greedy_reference) -> None:
    for max_tokens in range(1, 12):
        tokens, _, _ = run(
            PROMPT, target, drafts["self"], num_draft_tokens=4, max_tokens=max_tokens
        )
        assert tokens == greedy_reference[:max_tokens]


def test_logits_processors_apply_per_position(target, drafts) -> None:
    processors = make_logits_processors(
        logit_bias={7: 3.0}, repetition_penalty=1.5, repetition_context_size=8
    )
    plain = [
        t
        for t, _ in generate_step(
            mx.array(PROMPT), target, max_tokens=120, logits_processors=processors
        )
    ]
    unprocessed = [t for t, _ in generate_step(mx.array(PROMPT), target, max_tokens=120)]
    assert plain != unprocessed
    for kind in ("self", "truncated"):
        tokens, _, _ = run(
            PROMPT,
            target,
            drafts[kind],
            num_draft_tokens=4,
            max_tokens=120,
            logits_processors=processors,
        )
        assert tokens == plain


def test_yielded_logprobs_equal_plain_generation(target, drafts) -> None:
    plain = [np.array(lp) for _, lp in generate_step(mx.array(PROMPT), target, max_tokens=30)]
    steps = speculative_generate_step(
        mx.array(PROMPT), target, drafts["truncated"], num_draft_tokens=3, max_tokens=30
    )
    got = [np.array(lp) for _, lp, _ in steps]
    assert len(got) == 30
    for a, b in zip(got, plain, strict=True):
        assert a.shape == (256,)
        np.testing.assert_allclose(a, b, atol=2e-4)


# --- caches and host reads ---------------------------------------------------------------------


def offsets(cache) -> set[int]:
    return {c.offset for c in cache}


@pytest.mark.parametrize("stop", ["max_tokens", "eos", "caller_break"])
def test_caches_hold_prompt_and_emitted_tokens(target, drafts, greedy_reference, stop) -> None:
    cache = make_prompt_cache(target) + make_prompt_cache(drafts["truncated"])
    kwargs = {"num_draft_tokens": 5, "max_tokens": 97, "prompt_cache": cache}
    if stop == "eos":
        kwargs["eos_token_ids"] = [greedy_reference[40]]
    steps = speculative_generate_step(mx.array(PROMPT), target, drafts["truncated"], **kwargs)
    tokens = []
    for token, _, _ in steps:
        tokens.append(token)
        if stop == "caller_break" and len(tokens) == 33:
            break
    steps.close()
    expected = {"max_tokens": 97, "eos": greedy_reference.index(greedy_reference[40]) + 1}
    assert len(tokens) == expected.get(stop, 33)
    assert offsets(cache[:2]) == offsets(cache[2:]) == {len(PROMPT) + len(tokens)}
    # The caches hold exactly that text: continuing from them gives the greedy continuation.
    cont, _, _ = run(
        [greedy_reference[len(tokens)]],
        target,
        drafts["truncated"],
        prompt_cache=cache,
        max_tokens=5,
    )
    assert cont == greedy_reference[len(tokens) + 1 : len(tokens) + 6]


class HostReads:
    """Counts every way Python can make MLX wait for a value: eval, item, tolist, conversions."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        for name in ("tolist", "item", "__bool__", "__int__", "__float__", "__index__"):
            self._wrap(monkeypatch, mx.array, name)
        for name in ("eval", "synchronize"):
            self._wrap(monkeypatch, mx, name)

    def _wrap(self, monkeypatch, owner, name) -> None:
        original = getattr(owner, name)

        def counted(*args, **kwargs):
            self.count += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)


@pytest.mark.parametrize("temp", [0.0, 1.0])
def test_one_host_read_per_round(monkeypatch, target, drafts, temp) -> None:
    sampler = make_sampler(temp=temp)
    stats = SpeculativeStats()
    steps = speculative_generate_step(
        mx.array([PROMPT[0]]),  # one prompt token: no prefill
        target,
        drafts["truncated"],
        num_draft_tokens=3,
        max_tokens=60,
        sampler=sampler,
        key=mx.random.key(3),
        stats=stats,
    )
    reads = HostReads(monkeypatch)
    tokens = list(steps)
    monkeypatch.undo()
    assert len(tokens) == 60 and stats.rounds >= 15
    assert reads.count == stats.rounds


def test_unsupported_cache_raises_before_any_work(target, drafts) -> None:
    # A batch cache cannot be taken back for one sequence: refused by name, before any call.
    called = []

    class Spy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = target

        @property
        def layers(self):
            return target.layers

        def __call__(self, *args, **kwargs):
            called.append(1)
            return target(*args, **kwargs)

    cache = make_prompt_cache(target) + [BatchKVCache([0]) for _ in drafts["truncated"].layers]
    with pytest.raises(ValueError, match=r"speculative_generate_step: the draft model's.*BatchKVC"):
        speculative_generate_step(mx.array(PROMPT), Spy(), drafts["truncated"], prompt_cache=cache)
    assert not called


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"prompt": mx.array([], dtype=mx.int32)}, "`prompt`"),
        ({"prompt": mx.array([1.0, 2.0])}, "`prompt`"),
        ({"num_draft_tokens": -1}, "`num_draft_tokens`"),
        ({"max_tokens": -2}, "`max_tokens`"),
        ({"key": mx.array([1, 2, 3], dtype=mx.uint32)}, "`key`"),
    ],
)
def test_bad_arguments_raise_value_error(target, drafts, kwargs, match) -> None:
    prompt = kwargs.pop("prompt", mx.array(PROMPT))
    with pytest.raises(ValueError, match=rf"speculative_generate_step.*{match}"):
        speculative_generate_step(prompt, target, drafts["truncated"], **kwargs)


# --- temperature > 0 -----------------------------------------------------------------------------


def test_same_key_same_tokens_and_seed_works(target, drafts) -> None:
    sampler = make_sampler(temp=1.0)
    args = (PROMPT, target, drafts["truncated"])
    a, _, _ = run(*args, sampler=sampler, max_tokens=40, key=mx.random.key(5))
    b, _, _ = run(*args, sampler=sampler, max_tokens=40, key=mx.random.key(5))
    c, _, _ = run(*args, sampler=sampler, max_tokens=40, key=mx.random.key(6))
    longer, _, _ = run(*args, sampler=sampler, max_tokens=60, key=mx.random.key(5))
    assert a == b != c
    assert longer[:40] == a
    mx.random.seed(11)
    d, _, _ = run(*args, sampler=sampler, max_tokens=40)
    mx.random.seed(11)
    e, _, _ = run(*args, sampler=sampler, max_tokens=40)
    assert d == e


@pytest.mark.parametrize("temp", [0.0, 1.0])
def test_loop_verifies_with_the_fused_kernels_where_they_run(monkeypatch, target, drafts, temp):
    # On CUDA the loop passes fused=True: every round goes through the kernels' launch, and the
    # tokens are those of a run that is not recorded.
    args = (PROMPT, target, drafts["truncated"])
    options = dict(sampler=make_sampler(temp=temp), max_tokens=40, key=mx.random.key(7))
    plain, _, _ = run(*args, **options)
    launched = []
    # On CUDA the real kernels run (so the tokens are the kernels' on both runs); elsewhere the
    # launcher that runs the composition on the kernels' inputs.
    launcher = fused.launch if fused.available() else reference_launch

    def recorded(name, inputs, template):
        launched.append(name)
        return launcher(name, inputs, template)

    monkeypatch.setattr(fused, "launch", recorded)
    monkeypatch.setattr(fused, "available", lambda stream=None: True)
    # Uncompiled, every round builds its launch (a compiled graph is traced once per shape, and on
    # CUDA the first run traced it already).
    mx.disable_compile()
    try:
        tokens, _, stats = run(*args, **options)
    finally:
        mx.enable_compile()
    assert tokens == plain
    assert launched == ["greedy" if temp == 0 else "sampled"] * stats.rounds


def test_self_draft_is_always_accepted_at_temperature_one(target) -> None:
    # p == q: rejection sampling keeps every draft token (mlx-lm's rule would keep sum(p^2)).
    _, _, stats = run(
        PROMPT,
        target,
        target,
        sampler=make_sampler(temp=1.0),
        max_tokens=80,
        key=mx.random.key(0),
        num_draft_tokens=4,
    )
    assert stats.accepted == stats.drafted


def test_opaque_sampler_warns_and_matches(target, drafts, greedy_reference) -> None:
    def argmax_sampler(logprobs: mx.array) -> mx.array:
        return mx.argmax(logprobs, axis=-1)

    with pytest.warns(UserWarning, match="does not expose its distribution") as caught:
        tokens, _, stats = run(
            PROMPT, target, drafts["truncated"], sampler=argmax_sampler, max_tokens=100
        )
    assert len(caught) == 1
    assert tokens == greedy_reference[:100]
    assert stats.accepted > 0


def test_mlx_lm_greedy_sampler_is_greedy_without_warning(target, drafts, greedy_reference) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tokens, _, _ = run(
            PROMPT,
            target,
            drafts["truncated"],
            sampler=lm_sample_utils.make_sampler(temp=0.0),
            max_tokens=50,
        )
    assert tokens == greedy_reference[:50]


SMALL_VOCAB = 24


@pytest.fixture(scope="module")
def small_pair() -> tuple[llama.Model, llama.Model]:
    model = tiny_llama(3, vocab=SMALL_VOCAB, head=4.0)
    return model, truncated(model, 1)


def exact_joint(model: llama.Model, temp: float, **filters) -> np.ndarray:
    """``[V, V]`` float64: P(t1, t2) of plain sampling with mlx-lm's filters and temperature."""

    def dist(tokens: list[int]) -> np.ndarray:
        logits = model(mx.array(tokens)[None])[0, -1:].astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if filters.get("top_p"):
            logprobs = apply_top_p(logprobs, filters["top_p"])
        if filters.get("min_p"):
            logprobs = apply_min_p(logprobs, filters["min_p"])
        if filters.get("top_k"):
            logprobs = apply_top_k(logprobs, filters["top_k"])
        p = np.array(mx.softmax(logprobs * (1 / temp), axis=-1)[0], dtype=np.float64)
        return p / p.sum()

    first = dist(PROMPT)
    joint = np.zeros((SMALL_VOCAB, SMALL_VOCAB))
    for t1 in range(SMALL_VOCAB):
        if first[t1] > 0:
            joint[t1] = first[t1] * dist([*PROMPT, t1])
    return joint


def sampled_pairs(model, draft, sampler, samples: int, n: int = 2) -> np.ndarray:
    """``[V, V]`` counts of the first two tokens over ``samples`` runs with keys 0, 1, ...;
    the prompt is prefilled once and the caches trimmed back after each run."""
    cache = make_prompt_cache(model) + make_prompt_cache(draft)
    prompt = mx.array(PROMPT)
    model(prompt[None, :-1], cache=cache[:2])
    draft(prompt[None, :-1], cache=cache[2:])
    counts = np.zeros((SMALL_VOCAB, SMALL_VOCAB), dtype=np.int64)
    for i in range(samples):
        steps = speculative_generate_step(
            prompt[-1:],
            model,
            draft,
            sampler=sampler,
            num_draft_tokens=n,
            max_tokens=2,
            prompt_cache=cache,
            key=mx.random.key(i),
        )
        t1, t2 = (token for token, _, _ in steps)
        counts[t1, t2] += 1
        trim_prompt_cache(cache[:2], 3)
        trim_prompt_cache(cache[2:], 3)
    return counts


def chi_square_p(counts: np.ndarray, expected_probs: np.ndarray) -> float:
    """Pearson chi-square p-value; cells expecting fewer than 5 draws are pooled into one."""
    total = counts.sum()
    expected = expected_probs.ravel() * total
    observed = counts.ravel()
    assert observed[expected == 0].sum() == 0, "a token of probability 0 was emitted"
    big = expected >= 5
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    return float(
        scipy_stats.chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue
    )


# Threshold and sizes: a correct loop passes p > 1e-3 with these fixed keys; every negative control
# (a slightly wrong distribution) must give p < 1e-3 with the same sizes.
THRESHOLD = 1e-3


def test_first_two_tokens_have_the_target_distribution(small_pair) -> None:
    model, draft = small_pair
    expected = exact_joint(model, 1.0)
    counts = sampled_pairs(model, draft, make_sampler(temp=1.0), samples=1000)
    assert chi_square_p(counts, expected) > THRESHOLD


def test_negative_control_resampling_from_the_target_fails(small_pair, monkeypatch) -> None:
    # A classic bug: after a rejection, drawing `next` from p instead of norm(max(p - q, 0)).
    model, draft = small_pair
    expected = exact_joint(model, 1.0)

    def without_residual(probs, tokens, draft_probs, eos, key, **options):
        result = accept_sampled(probs, tokens, draft_probs, eos, key, **options)
        row = mx.take(probs, result[0], axis=0)
        token = mx.random.categorical(mx.log(row), key=mx.random.split(key)[1])
        return mx.stack([result[0], token.astype(mx.uint32), result[2]])

    monkeypatch.setattr(rules, "accept_sampled", without_residual)
    counts = sampled_pairs(model, draft, make_sampler(temp=1.0), samples=1000)
    assert chi_square_p(counts, expected) < THRESHOLD


@pytest.mark.statistical
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
def test_first_two_tokens_with_filters(small_pair, temp, filters) -> None:
    model, draft = small_pair
    expected = exact_joint(model, temp, **filters)
    sampler = make_sampler(temp=temp, **filters)
    counts = sampled_pairs(model, draft, sampler, samples=3000)
    assert chi_square_p(counts, expected) > THRESHOLD


@pytest.mark.statistical
def test_first_two_tokens_with_an_unrelated_draft(small_pair) -> None:
    model, _ = small_pair
    expected = exact_joint(model, 1.0)
    unrelated = tiny_llama(9, vocab=SMALL_VOCAB, head=4.0)
    counts = sampled_pairs(model, unrelated, make_sampler(temp=1.0), samples=3000)
    assert chi_square_p(counts, expected) > THRESHOLD


@pytest.mark.statistical
def test_negative_control_wrong_temperature_fails(small_pair) -> None:
    model, draft = small_pair
    expected = exact_joint(model, 1.0)
    counts = sampled_pairs(model, draft, make_sampler(temp=1.1), samples=3000)
    assert chi_square_p(counts, expected) < THRESHOLD


# --- memory ---------------------------------------------------------------------------------------


def test_memory_flat_over_a_long_generation(target, drafts) -> None:
    cache = make_prompt_cache(target) + make_prompt_cache(drafts["truncated"])
    steps = speculative_generate_step(
        mx.array(PROMPT),
        target,
        drafts["truncated"],
        sampler=make_sampler(temp=1.0),
        key=mx.random.key(0),
        num_draft_tokens=4,
        max_tokens=2000,
        prompt_cache=cache,
    )
    samples = []
    for i, _ in enumerate(steps):
        if i % 250 == 249:
            # Active memory beyond the caches, which grow by design.
            mx.eval([c.state for c in cache])
            # On a GPU, let the kernels in flight finish (and release their buffers) first.
            mx.synchronize()
            samples.append(mx.get_active_memory() - sum(c.nbytes for c in cache))
    assert len(samples) == 8
    # A leak lifts every later reading; a transient on a GPU (likely buffers of kernels still
    # finishing) lifts one reading at a time (seen on CUDA: +1.1 MB once, back at the next). On
    # CUDA the readings also creep by ~1 KB per KV-cache growth step (the same with the fused
    # kernels and the composition; likely the allocator rounding the growing buffers), far under
    # the bound.
    early, late = min(samples[1:4]), min(samples[-3:])
    assert late - early < 256 * 1024, samples


def test_memory_flat_over_10000_acceptance_rounds() -> None:
    vocab, n = 64, 4
    p = mx.softmax(mx.random.normal((n + 1, vocab), key=mx.random.key(0)), axis=-1)
    q = mx.softmax(mx.random.normal((n, vocab), key=mx.random.key(1)), axis=-1)
    draft = mx.array([3, 9, 27, 81 % vocab], dtype=mx.uint32)
    eos = mx.array([0], dtype=mx.uint32)
    mx.eval(p, q)
    key = mx.random.key(2)
    for _ in range(100):
        key, sub = mx.random.split(key)
        read(accept_sampled(p, draft, q, eos, sub))
    before = mx.get_active_memory()
    accepted = 0
    for _ in range(10_000):
        key, sub = mx.random.split(key)
        accepted += read(accept_sampled(p, draft, q, eos, sub))[0]
    assert mx.get_active_memory() - before < 64 * 1024
    assert 0 < accepted < 4 * 10_000


# --- stream_generate, generate and the mlx-lm patch ---------------------------------------------


def test_stream_generate_matches_mlx_lm_plain(target, drafts) -> None:
    tokenizer = ByteTokenizer()
    plain = list(lm_generate.stream_generate(target, tokenizer, PROMPT, max_tokens=50))
    stats = SpeculativeStats()
    ours = list(
        stream_generate(
            target, tokenizer, PROMPT, max_tokens=50, draft_model=drafts["truncated"], stats=stats
        )
    )
    assert [r.token for r in ours] == [r.token for r in plain]
    assert "".join(r.text for r in ours) == "".join(r.text for r in plain)
    assert [r.finish_reason for r in ours] == [r.finish_reason for r in plain]
    assert [r.generation_tokens for r in ours] == [r.generation_tokens for r in plain]
    assert all(isinstance(r, SpeculativeResponse) for r in ours)
    last = ours[-1].stats
    assert last == stats and last.generated == 50 and last.rounds < 50
    assert stats.rounds - 1 <= [r.from_draft for r in ours].count(False) <= stats.rounds


def test_stream_generate_stops_at_tokenizer_eos(target, drafts, greedy_reference) -> None:
    stop = greedy_reference[30]

    class Tok(ByteTokenizer):
        eos_token_id = stop

    plain = list(lm_generate.stream_generate(target, Tok(), PROMPT, max_tokens=100))
    cache = make_prompt_cache(target) + make_prompt_cache(drafts["self"])
    ours = list(
        stream_generate(
            target,
            Tok(),
            PROMPT,
            max_tokens=100,
            draft_model=drafts["self"],
            num_draft_tokens=8,
            prompt_cache=cache,
        )
    )
    assert ours[-1].finish_reason == plain[-1].finish_reason == "stop"
    assert [r.token for r in ours] == [r.token for r in plain]
    # The EOS token is in the caches, as the server's cache key expects.
    assert offsets(cache) == {len(PROMPT) + greedy_reference.index(stop) + 1}


def test_generate_returns_text_and_fills_stats(target, drafts) -> None:
    tokenizer = ByteTokenizer()
    plain = lm_generate.generate(target, tokenizer, PROMPT, max_tokens=40)
    stats = SpeculativeStats()
    text = spec_generation.generate(
        target, tokenizer, PROMPT, max_tokens=40, draft_model=drafts["truncated"], stats=stats
    )
    assert text == plain and stats.generated == 40 and stats.rounds > 0


@pytest.fixture
def patched():
    patch_mlx_lm()
    yield
    unpatch_mlx_lm()


def test_patch_routes_mlx_lm_stream_generate_through_mlx_spec(patched, target) -> None:
    import mlx_lm

    sampler = lm_sample_utils.make_sampler(temp=1.0)  # made through the patched factory
    mx.random.seed(4)
    responses = list(
        mlx_lm.stream_generate(
            target,
            ByteTokenizer(),
            PROMPT,
            max_tokens=41,
            draft_model=target,
            num_draft_tokens=4,
            sampler=sampler,
        )
    )
    # The target drafting for itself: rejection sampling keeps every draft token, so every round
    # yields 5 tokens, 4 of them from the draft (mlx-lm's rule keeps a draft token with
    # probability sum(p^2) only); the 41st token, alone in its round, is the target's.
    flags = [r.from_draft for r in responses]
    assert flags == ([True] * 4 + [False]) * 8 + [False]
    mx.random.seed(4)
    ours, _, _ = run(PROMPT, target, target, sampler=sampler, max_tokens=41, num_draft_tokens=4)
    assert [r.token for r in responses] == ours


def test_patch_keeps_plain_sampling_unchanged(target) -> None:
    def sample(factory):
        mx.random.seed(8)
        return [
            t
            for t, _ in generate_step(
                mx.array(PROMPT), target, max_tokens=30, sampler=factory(temp=0.9, top_p=0.9)
            )
        ]

    before = sample(lm_sample_utils.make_sampler)
    patch_mlx_lm()
    try:
        during = sample(lm_sample_utils.make_sampler)
        assert callable(lm_sample_utils.make_sampler(temp=0.9).probs)
    finally:
        unpatch_mlx_lm()
    assert during == before


def mlx_lm_package():
    import mlx_lm

    return mlx_lm


def test_patch_and_unpatch_are_idempotent_and_exact() -> None:
    server = pytest.importorskip("mlx_lm.server")
    originals = (
        lm_generate.speculative_generate_step,
        lm_sample_utils.make_sampler,
        lm_generate.make_sampler,
        server.make_sampler,
        lm_generate.stream_generate,
    )
    patch_mlx_lm()
    patch_mlx_lm()
    assert lm_generate.speculative_generate_step is speculative_generate_step
    for module in (lm_sample_utils, lm_generate, server):
        assert module.make_sampler is not originals[1]
        assert callable(module.make_sampler(temp=0.5).probs)
    # stream_generate is replaced too, so that mlx-lm's own `max_kv_size` reaches the loop.
    assert lm_generate.stream_generate is not originals[4]
    assert mlx_lm_package().stream_generate is lm_generate.stream_generate
    unpatch_mlx_lm()
    unpatch_mlx_lm()
    assert (
        lm_generate.speculative_generate_step,
        lm_sample_utils.make_sampler,
        lm_generate.make_sampler,
        server.make_sampler,
        lm_generate.stream_generate,
    ) == originals


def test_patched_mlx_lm_command_accepts_by_rejection_sampling(
    patched, target, monkeypatch, capsys
) -> None:
    # `mlx_lm.generate` (the command) with the target as its own draft at temperature 1: mlx-lm's
    # main builds its sampler with the patched make_sampler, so mlx-spec rejection-samples, and
    # with p == q every draft token is kept.
    class Tok(ByteTokenizer):
        vocab_size = 256

    from mlx_lm.tokenizer_utils import TokenizerWrapper

    tokenizer = TokenizerWrapper(Tok())

    def load(path, **kwargs):
        return (target, tokenizer, {}) if kwargs.get("return_config") else (target, tokenizer)

    rounds = []
    original_round = spec_generation._Generation.round

    def counted_round(self, remaining):
        out = original_round(self, remaining)
        rounds.append((self.rule.kind, self.lengths.most, out[1]))
        return out

    monkeypatch.setattr(lm_generate, "load", load)
    monkeypatch.setattr(spec_generation._Generation, "round", counted_round)
    argv = "mlx_lm.generate --model m --draft-model d --num-draft-tokens 4 --temp 1.0"
    argv += " --max-tokens 21 --seed 0 --ignore-chat-template --prompt hello"
    monkeypatch.setattr(sys, "argv", argv.split())
    lm_generate.main()
    assert capsys.readouterr().out
    assert rounds and {mode for mode, _, _ in rounds} == {"sampled"}
    # Every draft token kept, and no round drafts more than the tokens left after its own.
    assert all(from_draft == min(n, 20 - 5 * i) for i, (_, n, from_draft) in enumerate(rounds))
