"""The exact distribution of the first two generated tokens, and a chi-square test against it.

:func:`exact_joint` computes ``P(t1, t2)`` of plain sampling from the target alone: mlx-lm's
``generate_step`` (prefill, then one token at a time) with the given caches, made to emit each
``t1`` in turn, then mlx-lm's own filters (``apply_top_p``, ``apply_min_p``, ``apply_top_k``) and
temperature. :func:`sampled_pairs`
counts the first two tokens of speculative generation over fixed keys ``0, 1, ...``, each run
from a copy of caches that hold the prompt's first tokens (the tokens of a run on new caches, at
a fraction of the cost). A correct loop passes
:func:`chi_square_p` above :data:`THRESHOLD`; the negative controls beside each use of these
helpers must fall below it at the same sample size.

Each sample runs a whole generation, so sample sizes are chosen by a power calculation: the
statistic of ``n`` draws from a wrong joint ``w`` is noncentral chi-square with noncentrality
``n * sum((w - p)**2 / p)`` over the cells :func:`chi_square_p` forms at that ``n``
(:func:`chi_square_power`). Where ``w`` is known exactly (a wrong temperature: it is plain
sampling's joint at that temperature) the tests compute the power; where a control breaks the
loop, its effect ``sum((w - p)**2 / p)`` was estimated from its counts over more keys, ``(X^2 -
df) / n``, and the comment beside it gives the estimate and the power it yields. A control must
fail with a chance of at least :data:`POWER`, and the positive tests beside it use its size.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step, maybe_quantize_kv_cache
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p
from scipy import stats as scipy_stats

from mlx_spec.generation import speculative_generate_step

#: A correct loop gives p > THRESHOLD with the fixed keys; every negative control, p < THRESHOLD.
THRESHOLD = 1e-3
#: The chance each negative control has to fail at the sample size its tests use.
POWER = 0.999
#: The temperature of the wrong-temperature controls, which stand beside tests of samplers with
#: filters. Their joint is plain sampling's at this temperature, so their power is exact; their
#: effect on the 24-token llama, about 0.15, is that of the weakest loop bug the controls here
#: inject (a residual drawn from ``p``: 0.15 to 0.2), and needs 400 to 650 samples. A temperature
#: 10% off would need 4,000 to 6,000 a test.
WRONG_TEMPERATURE = 1.3

CacheMaker = Callable[[Any], list[Any]]


def exact_joint(
    model: Any,
    prompt: list[int],
    vocab: int,
    temp: float = 1.0,
    make_cache: CacheMaker = make_prompt_cache,
    options: dict[str, Any] | None = None,
    **filters: float,
) -> np.ndarray:
    """``[V, V]`` float64: P(t1, t2) of sampling the target alone with mlx-lm's filters."""

    def dist(logprobs: mx.array) -> np.ndarray:
        logprobs = logprobs[None].astype(mx.float32)
        if filters.get("top_p"):
            logprobs = apply_top_p(logprobs, filters["top_p"])
        if filters.get("min_p"):
            logprobs = apply_min_p(logprobs, filters["min_p"])
        if filters.get("top_k"):
            logprobs = apply_top_k(logprobs, filters["top_k"])
        p = np.array(mx.softmax(logprobs * (1 / temp), axis=-1)[0], dtype=np.float64)
        return p / p.sum()

    def plain(t1: int) -> tuple[np.ndarray, np.ndarray]:
        """The distributions of the first token, and of the second after ``t1``: plain decoding
        that emits ``t1`` first, so every position is computed as mlx-lm's loop computes it."""

        def forced(logprobs: mx.array) -> mx.array:
            return mx.full(logprobs.shape[:-1], t1, dtype=mx.uint32)

        steps = generate_step(
            mx.array(prompt),
            model,
            max_tokens=2,
            sampler=forced,
            prompt_cache=make_cache(model),
            **(options or {}),
        )
        (_, first), (_, second) = steps
        return dist(first), dist(second)

    first = plain(0)[0]
    joint = np.zeros((vocab, vocab))
    for t1 in range(vocab):
        if first[t1] > 0:
            joint[t1] = first[t1] * plain(t1)[1]
    return joint


def sampled_pairs(
    model: Any,
    prompt: list[int],
    vocab: int,
    samples: int,
    make_cache: CacheMaker = make_prompt_cache,
    draft_model: Any = None,
    *,
    prefilled: bool = True,
    **kwargs: Any,
) -> np.ndarray:
    """``[V, V]`` counts of the first two tokens of ``samples`` speculative runs with keys
    ``0, 1, ...``; ``kwargs`` go to ``speculative_generate_step`` (``sampler``, ``drafter``,
    ``num_draft_tokens``, ...).

    With ``prefilled`` (the default), the models are fed all of ``prompt`` but its last token
    once, and each run starts from a copy of those caches (``prompt_cache`` and
    ``cached_tokens``): a run's tokens are then those of a run on new caches with the same key
    (``test_prefilled_runs_are_the_runs_on_new_caches``), in a third to two thirds of the time on
    the tiny models. Without it, each run starts on new caches."""
    models = [model] if draft_model is None else [model, draft_model]
    start = _prefilled(models, prompt, make_cache, kwargs) if prefilled else None
    counts = np.zeros((vocab, vocab), dtype=np.int64)
    for i in range(samples):
        if start is None:
            fed, history = prompt, None
            cache = [c for m in models for c in make_cache(m)]
        else:
            fed, history, cache = prompt[-1:], prompt[:-1], copy.deepcopy(start)
        steps = speculative_generate_step(
            mx.array(fed),
            model,
            draft_model,
            max_tokens=2,
            prompt_cache=cache,
            cached_tokens=history,
            key=mx.random.key(i),
            **kwargs,
        )
        t1, t2 = (token for token, _, _ in steps)
        counts[t1, t2] += 1
    return counts


def _prefilled(
    models: list[Any], prompt: list[int], make_cache: CacheMaker, options: dict[str, Any]
) -> list[Any]:
    """The caches of ``models`` (in order, one list) holding ``prompt`` but its last token, fed
    and quantized as the loop's prefill feeds and quantizes them."""
    caches = []
    for model in models:
        cache = make_cache(model)
        model(mx.array(prompt[:-1])[None], cache=cache)
        if options.get("kv_bits") is not None:
            maybe_quantize_kv_cache(
                cache,
                options.get("quantized_kv_start", 0),
                options.get("kv_group_size", 64),
                options["kv_bits"],
            )
        mx.eval([c.state for c in cache])
        caches += cache
    return caches


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


def chi_square_power(expected_probs: np.ndarray, wrong_probs: np.ndarray, samples: int) -> float:
    """The chance that :func:`chi_square_p` of ``samples`` draws from ``wrong_probs`` against
    ``expected_probs`` (both ``[V, V]``) fails: a pair of probability 0 is drawn, or the p-value
    falls below :data:`THRESHOLD` (the statistic over the same cells is noncentral chi-square)."""
    p, w = expected_probs.ravel() / expected_probs.sum(), wrong_probs.ravel() / wrong_probs.sum()
    if w[p == 0].sum() > 1 - 1e-9:
        return 1.0
    outside = 1 - (1 - w[p == 0].sum()) ** samples
    big = p * samples >= 5
    cells_p = np.append(p[big], p[~big & (p > 0)].sum())
    cells_w = np.append(w[big], w[~big & (p > 0)].sum()) / (1 - w[p == 0].sum())
    keep = cells_p > 0
    df = int(keep.sum()) - 1
    noncentrality = samples * float(((cells_w[keep] - cells_p[keep]) ** 2 / cells_p[keep]).sum())
    critical = scipy_stats.chi2.isf(THRESHOLD, df)
    return float(1 - (1 - outside) * scipy_stats.ncx2.cdf(critical, df, noncentrality))
