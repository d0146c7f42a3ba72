"""The speculative generation loop against mlx-lm's plain generation, with tiny real llama models.

Models are ``mlx_lm.models.llama`` with fixed random float32 weights (``tests/tiny_models.py``, no
downloads): a target whose first layer dominates its second and whose output layer is scaled up,
so its distributions are peaked and its greedy text varied; drafts are the target itself, the
target cut to its first layer (agrees on about 3 of 4 tokens at temperature 0) and an unrelated
random model (almost never agrees). The distribution tests are in ``test_generation_sampled.py``,
mlx-lm's entry points and the patch in ``test_patch.py``, other cache classes in
``test_caches.py`` and the drafters in ``test_drafters.py``.
"""

from __future__ import annotations

import warnings

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import tiny_models
from helpers import PROMPT, memory_beyond_caches, run
from kernel_reference import reference_launch
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache
from mlx_lm.sample_utils import make_logits_processors
from mlx_lm.sample_utils import make_sampler as lm_make_sampler
from tiny_models import cut, tiny_llama

from mlx_spec import _mlx_lm, kernels, keys, loop
from mlx_spec._checks import device_type
from mlx_spec.acceptance import accept_sampled, read
from mlx_spec.drafters import Draft, Drafter
from mlx_spec.generation import SpeculativeStats, speculative_generate_step
from mlx_spec.sampling import make_sampler

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
    # Prompt lookup, adaptive: rounds and stretches of plain steps, each step processed with the
    # text up to it.
    stretches = []
    original = loop.Generation._stretch

    def counted(self, count, guess):
        stretches.append(count)
        return original(self, count, guess)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loop.Generation, "_stretch", counted)
        steps = speculative_generate_step(
            mx.array(PROMPT),
            target,
            drafter="prompt-lookup",
            adaptive=True,
            num_draft_tokens=4,
            max_tokens=120,
            logits_processors=processors,
        )
        assert [t for t, _, _ in steps] == plain
    assert stretches


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


@pytest.mark.parametrize("fail_at", [1, 3])
def test_an_error_in_a_round_leaves_the_prompt_and_yielded_tokens(
    target, drafts, greedy_reference, fail_at
) -> None:
    # A logits processor that fails at its fail_at-th call: in the first round (the draft's
    # first step, or the target's rows), the caches must hold exactly the prompt; a reused
    # cache then continues plain decoding's text.
    calls = []

    def failing(tokens: mx.array, logits: mx.array) -> mx.array:
        calls.append(1)
        if len(calls) == fail_at:
            raise RuntimeError("processor failed")
        return logits

    cache = make_prompt_cache(target) + make_prompt_cache(drafts["truncated"])
    steps = speculative_generate_step(
        mx.array(PROMPT),
        target,
        drafts["truncated"],
        num_draft_tokens=2,
        prompt_cache=cache,
        logits_processors=[failing],
    )
    with pytest.raises(RuntimeError, match="processor failed"):
        next(steps)
    assert offsets(cache) == {len(PROMPT)}
    more, _, _ = run([greedy_reference[0]], target, drafts["truncated"], prompt_cache=cache)
    assert more == greedy_reference[1:257]


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
    # Once-per-process probes read the device, the first time this process draws a coupled
    # token (how MLX draws a batch's rows) or computes a key chain (whether MLX's split is the
    # host's): not a round's reads.
    _mlx_lm.rows_by_inverse_cdf()
    keys._split()
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
        ({"prompt_cache": ["a", "b", "c"]}, r"the target's caches \(`prompt_cache`\) include str"),
        pytest.param(
            {"stream": mx.Device(mx.gpu)},
            r"`stream` is Device\(gpu, 0\), a device this MLX cannot run on",
            marks=pytest.mark.skipif(mx.is_available(mx.gpu), reason="a GPU can run it"),
        ),
    ],
)
def test_bad_arguments_raise_value_error(target, drafts, kwargs, match) -> None:
    prompt = kwargs.pop("prompt", mx.array(PROMPT))
    with pytest.raises(ValueError, match=rf"speculative_generate_step.*{match}"):
        speculative_generate_step(prompt, target, drafts["truncated"], **kwargs)


def test_an_invalid_verification_row_raises_naming_its_position(target, drafts) -> None:
    def nan_logits(tokens: mx.array, logits: mx.array) -> mx.array:
        return logits * mx.nan

    with pytest.raises(ValueError, match=r"^speculative_generate_step: .* at position 0 decided"):
        run(PROMPT, target, drafts["self"], max_tokens=4, logits_processors=[nan_logits])


def test_a_tiny_temperature_with_float16_models_generates() -> None:
    # 1 / 1e-5 overflows float16; the sampler scales those rows in float32 (issue 15), where
    # they used to be NaN and stop the loop.
    target = tiny_llama(0)
    target.set_dtype(mx.float16)
    draft = cut(target, 1)
    sampler = make_sampler(temp=1e-5)
    tokens, _, _ = run(PROMPT, target, draft, max_tokens=24, sampler=sampler, key=mx.random.key(0))
    assert len(tokens) == 24 and all(0 <= t < 256 for t in tokens)


def test_same_key_same_tokens_and_seed_works(target, drafts) -> None:
    sampler = make_sampler(temp=1.0)
    args = (PROMPT, target, drafts["truncated"])
    a, _, _ = run(*args, sampler=sampler, max_tokens=40, key=mx.random.key(5))
    b, _, _ = run(*args, sampler=sampler, max_tokens=40, key=mx.random.key(5))
    c, _, _ = run(*args, sampler=sampler, max_tokens=40, key=mx.random.key(6))
    longer, _, _ = run(*args, sampler=sampler, max_tokens=60, key=mx.random.key(5))
    assert a == b != c
    # Rounds are the same until fewer than N + 1 = 4 tokens are left (then they draft fewer).
    assert longer[:37] == a[:37]
    mx.random.seed(11)
    d, _, _ = run(*args, sampler=sampler, max_tokens=40)
    mx.random.seed(11)
    e, _, _ = run(*args, sampler=sampler, max_tokens=40)
    assert d == e


@pytest.mark.parametrize(
    ("temp", "acceptance", "kernel"),
    [(0.0, "coupled", "greedy"), (1.0, "residual", "sampled"), (1.0, "coupled", None)],
)
def test_loop_verifies_with_the_fused_kernels_where_they_run(
    monkeypatch, target, drafts, temp, acceptance, kernel
):
    # On CUDA the loop passes fused=True: every round of a rule with kernels goes through their
    # launch, and the tokens are those of a run that is not recorded. Coupled sampling draws
    # each position's token as mlx-lm does, with no kernel.
    args = (PROMPT, target, drafts["truncated"])
    options = dict(
        sampler=make_sampler(temp=temp), max_tokens=40, key=mx.random.key(7), acceptance=acceptance
    )
    plain, _, _ = run(*args, **options)
    launched = []
    # On CUDA the real kernels run (so the tokens are the kernels' on both runs); elsewhere the
    # launcher that runs the composition on the kernels' inputs.
    launcher = kernels.launch if kernels.available() else reference_launch

    def recorded(name, inputs, template):
        launched.append(name)
        return launcher(name, inputs, template)

    monkeypatch.setattr(kernels, "launch", recorded)
    monkeypatch.setattr(kernels, "available", lambda stream=None: True)
    # Uncompiled, every round builds its launch (a compiled graph is traced once per shape, and on
    # CUDA the first run traced it already).
    mx.disable_compile()
    try:
        tokens, _, stats = run(*args, **options)
    finally:
        mx.enable_compile()
    assert tokens == plain
    # Every round that drafted; plain steps draw their token without the acceptance kernels.
    verifications = stats.drafted_at[0]
    assert verifications > 0
    assert launched == ([kernel] * verifications if kernel else [])


@pytest.mark.parametrize(
    "stream", [mx.Device(mx.cpu), mx.new_stream(mx.cpu)], ids=["device", "stream"]
)
def test_loop_asks_for_the_kernels_on_its_own_stream(monkeypatch, target, drafts, stream):
    # A CUDA machine, whose default device is the GPU, told to generate on the CPU: the rounds
    # run on the CPU, where the kernels cannot.
    launched = []

    def recorded(name, inputs, template):
        launched.append(name)
        return reference_launch(name, inputs, template)

    def available(stream=None):
        return stream is None or device_type(stream) == mx.DeviceType.gpu

    monkeypatch.setattr(kernels, "launch", recorded)
    monkeypatch.setattr(kernels, "available", available)
    _, _, stats = run(PROMPT, target, drafts["truncated"], max_tokens=16, stream=stream)
    assert stats.rounds > 0
    assert launched == []


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


def test_opaque_sampler_is_called_per_position(target, drafts, greedy_reference) -> None:
    # A sampler that exposes no distribution is called on each row with the position's state:
    # an argmax sampler gives greedy decoding, and its drafts are kept.
    def argmax_sampler(logprobs: mx.array) -> mx.array:
        return mx.argmax(logprobs, axis=-1)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tokens, _, stats = run(
            PROMPT, target, drafts["truncated"], sampler=argmax_sampler, max_tokens=100
        )
    assert tokens == greedy_reference[:100]
    assert stats.accepted > 0


def test_mlx_lm_greedy_sampler_is_greedy_without_warning(target, drafts, greedy_reference) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tokens, _, _ = run(
            PROMPT,
            target,
            drafts["truncated"],
            sampler=lm_make_sampler(temp=0.0),
            max_tokens=50,
        )
    assert tokens == greedy_reference[:50]


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
    samples = memory_beyond_caches(steps, cache, 250)
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


# --- interrupts, drafters of one's own, cache states mlx-lm's plain loop handles ---------------


class Interrupting(nn.Module):
    """A module that raises ``KeyboardInterrupt`` at its ``at``-th call (a Ctrl-C landing inside
    the model, after the attention layers before it appended to their caches)."""

    def __init__(self, layer: nn.Module, at: int) -> None:
        super().__init__()
        self.layer = layer
        self.calls = 0
        self.at = at

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.at:
            raise KeyboardInterrupt
        return self.layer(*args, **kwargs)


@pytest.mark.parametrize("at", [2, 4, 7])
@pytest.mark.parametrize("drafting", ["model", "lookup"])
def test_an_interrupt_inside_the_model_leaves_the_prompt_and_yielded_tokens(
    target, drafts, greedy_reference, at, drafting
) -> None:
    model = tiny_llama(0)  # the conftest target's weights, its second layer's MLP wrapped
    model.model.layers[1].mlp = Interrupting(model.model.layers[1].mlp, at)
    draft = drafts["truncated"] if drafting == "model" else None
    cache = make_prompt_cache(model) + (make_prompt_cache(draft) if draft is not None else [])
    kwargs = {} if draft is not None else {"drafter": "prompt-lookup"}
    steps = speculative_generate_step(
        mx.array(PROMPT), model, draft, num_draft_tokens=3, prompt_cache=cache, max_tokens=60,
        **kwargs,
    )  # fmt: skip
    yielded = []
    with pytest.raises(KeyboardInterrupt):
        for token, _, _ in steps:
            yielded.append(token)
    assert yielded == greedy_reference[: len(yielded)]
    # Every layer, the draft model's too, holds the prompt and the tokens yielded...
    assert offsets(cache) == {len(PROMPT) + len(yielded)}
    # ... so the next turn continues plain greedy decoding.
    model.model.layers[1].mlp.at = 0
    more, _, _ = run([greedy_reference[len(yielded)]], model, draft, prompt_cache=cache,
                     max_tokens=20, **kwargs)  # fmt: skip
    assert more == greedy_reference[len(yielded) + 1 : len(yielded) + 21]


def test_an_interrupt_while_the_caches_are_taken_back_keeps_them_whole(
    target, drafts, greedy_reference, monkeypatch
) -> None:
    # A Ctrl-C between two layers' trims after a rejection.
    from mlx_spec import caches

    original, calls = caches._trim, []

    def trim(layer, n):
        calls.append(n)
        if len(calls) == 5:
            raise KeyboardInterrupt
        original(layer, n)

    monkeypatch.setattr(caches, "_trim", trim)
    cache = make_prompt_cache(target) + make_prompt_cache(drafts["unrelated"])
    steps = speculative_generate_step(
        mx.array(PROMPT), target, drafts["unrelated"], num_draft_tokens=3, prompt_cache=cache,
        max_tokens=60,
    )  # fmt: skip
    yielded = []
    with pytest.raises(KeyboardInterrupt):
        for token, _, _ in steps:
            yielded.append(token)
    monkeypatch.undo()
    assert offsets(cache) == {len(PROMPT) + len(yielded)}
    more, _, _ = run([greedy_reference[len(yielded)]], target, drafts["unrelated"],
                     prompt_cache=cache, max_tokens=10)  # fmt: skip
    assert more == greedy_reference[len(yielded) + 1 : len(yielded) + 11]


class Proposing(Drafter):
    """Proposes ``tokens`` with the distributions ``rows``: a drafter of one's own."""

    def __init__(self, tokens: list[int], rows: np.ndarray) -> None:
        self.tokens, self.rows = tokens, rows

    def propose(self, text, n, keys) -> Draft:
        tokens = mx.array(self.tokens[:n], dtype=mx.uint32)
        return Draft(tokens, mx.array(self.rows[:n].astype(np.float32)))


@pytest.mark.parametrize("acceptance", ["residual", "coupled"])
@pytest.mark.parametrize(
    ("problem", "change"),
    [
        ("own token at 0", lambda rows, tokens: rows.__setitem__((1, tokens[1]), 0)),
        ("a total far below 1", lambda rows, tokens: rows.__imul__(0.5)),
        ("a negative entry", lambda rows, tokens: rows.__setitem__((0, 0), -0.25)),
    ],
)
def test_a_drafters_rows_that_are_no_distribution_raise(target, acceptance, problem, change):
    # Kept by the ratio test whenever p > 0, a token of probability 0 in its own row would bias
    # the output towards the drafter's tokens: refused at the round's read, naming the drafter.
    tokens = [7, 9, 11]
    rows = np.full((3, 256), 1 / 256)
    change(rows, tokens)
    rows[:, 0] += 1 - rows.sum(axis=1) if problem == "own token at 0" else 0
    drafter = Proposing(tokens, rows)
    with pytest.raises(ValueError, match=r"^speculative_generate_step: Proposing\.propose "
                       r"returned probs whose row [01] is not the distribution"):  # fmt: skip
        run(PROMPT, target, None, drafter=drafter, num_draft_tokens=3, max_tokens=8,
            sampler=make_sampler(temp=1.0), key=mx.random.key(0),
            acceptance=acceptance)  # fmt: skip


def test_a_drafters_proper_rows_are_accepted(target) -> None:
    rows = np.full((3, 256), 1 / 256)
    tokens, _, stats = run(
        PROMPT, target, None, drafter=Proposing([7, 9, 11], rows), num_draft_tokens=3,
        max_tokens=12, sampler=make_sampler(temp=1.0), key=mx.random.key(0),
        acceptance="residual",
    )  # fmt: skip
    assert len(tokens) == 12 and stats.drafted > 0


@pytest.mark.parametrize("prompt", [[5], [5, 9, 11, 40]], ids=["one token", "four tokens"])
@pytest.mark.parametrize("reused", [False, True])
def test_kv_bits_with_caches_already_past_the_start_equal_plain_decoding(prompt, reused):
    # mlx-lm quantizes a cache after the first call that leaves it at or past
    # quantized_kv_start: a verification must not score several positions in full precision
    # there (a one-token prompt with quantized_kv_start=0, or a reused cache).
    model = tiny_llama(3, hidden=128, heads=4, intermediate=256, head=12.0)
    draft = cut(model, 1)
    # Two bits, so that quantizing a position or not moves its logits enough to tell.
    options = dict(kv_bits=2, kv_group_size=32, quantized_kv_start=0 if not reused else 6)

    def caches(m):
        c = make_prompt_cache(m)
        if reused:  # a turn before: 7 tokens already in full precision
            m(mx.array([[3, 1, 4, 1, 5, 9, 2]]), cache=c)
        return c

    plain = [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=40,
                                         prompt_cache=caches(model), **options)]  # fmt: skip
    tokens, _, stats = run(prompt, model, draft, num_draft_tokens=4, max_tokens=40,
                           prompt_cache=caches(model) + caches(draft), **options)  # fmt: skip
    assert tokens == plain and stats.accepted > 0


@pytest.mark.parametrize("size", [1, 3, 4])
def test_a_window_no_larger_than_what_it_keeps_is_refused_up_front(size) -> None:
    from tiny_models import tiny_qwen2

    model = tiny_qwen2(0)  # no make_cache of its own: mlx-lm's rotating caches keep 4 tokens
    with pytest.raises(ValueError, match=rf"RotatingKVCache of {size} tokens .* `max_kv_size`"):
        speculative_generate_step(
            mx.array(PROMPT), model, drafter="prompt-lookup",
            prompt_cache=make_prompt_cache(model, max_kv_size=size),
        )  # fmt: skip


def test_prompt_lookup_drafts_from_what_a_reused_cache_holds() -> None:
    # A second turn of a chat: the cache holds the first turn, and the prompt is only the new
    # part (as mlx-lm's server passes it). Told what the cache holds, prompt lookup copies from
    # the first turn too; the text is plain decoding's either way.
    import copy

    import mlx_lm

    from mlx_spec._demo import DEMO_DIR

    model, tokenizer = mlx_lm.load(str(DEMO_DIR / "target"))
    first = tokenizer.encode("def read_config(path):\n    config = {}\n")
    cache = make_prompt_cache(model)
    steps = speculative_generate_step(
        mx.array(first), model, drafter="prompt-lookup", max_tokens=60, prompt_cache=cache
    )
    reply = [t for t, _, _ in steps]
    second = tokenizer.encode("\n\ndef read_config(path):\n", add_special_tokens=False)
    steps = generate_step(mx.array(second), model, max_tokens=60, prompt_cache=copy.deepcopy(cache))
    plain = [t for t, _ in steps]
    rounds = {}
    for told in (False, True):
        tokens, _, stats = run(
            second, model, None, drafter="prompt-lookup", num_draft_tokens=4, max_tokens=60,
            prompt_cache=copy.deepcopy(cache), cached_tokens=first + reply if told else None,
        )  # fmt: skip
        assert tokens == plain
        rounds[told] = stats.rounds
    assert rounds[True] < 0.85 * rounds[False]


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ("abc", "a sequence of token ids"),
        ([1, -2], r"int token ids in \[0, 2\*\*32\)"),
        (mx.zeros((2, 2), dtype=mx.int32), r"\[L\] integer token ids"),
    ],
)
def test_cached_tokens_are_checked(target, value, match) -> None:
    with pytest.raises(
        ValueError, match=rf"^speculative_generate_step: `cached_tokens` must .*{match}"
    ):
        speculative_generate_step(mx.array(PROMPT), target, drafter="prompt-lookup",
                                  cached_tokens=value)  # fmt: skip


def _modules_in_a_dict() -> nn.Module:
    model = nn.Module()
    model.parts = {"first": nn.Linear(2, 2), "rest": [nn.RMSNorm(2), {"last": nn.Linear(2, 2)}]}
    model.head = nn.Linear(2, 2)
    return model


WALKED = ["tiny_llama", "tiny_gemma3", "tiny_lfm2", "tiny_qwen3_next_moe", "tiny_qwen3_5_moe"]
WALKED += ["tiny_deepseek_v3", "tiny_glm4_moe", "in a dict"]


@pytest.mark.parametrize("build", WALKED)
def test_the_module_walk_finds_what_modules_finds_in_its_order(build: str) -> None:
    # Layers in lists, experts in lists and switch layers, MoE blocks, modules in a dict: a walk
    # that skipped a list or a dict, or went in another order, would differ.
    model = _modules_in_a_dict() if build == "in a dict" else getattr(tiny_models, build)(0)
    mine = list(_mlx_lm.modules(model))
    assert [id(m) for m in mine] == [id(m) for m in model.modules()]
    assert len(mine) >= 5
