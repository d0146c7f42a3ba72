"""The acceptance rule of a generation, decided once from its sampler.

- ``"greedy"`` (no sampler, a greedy sampler, or mlx-lm's greedy sampler): drafters take the
  argmax and :func:`mlx_spec.accept_greedy` keeps what the target's argmax agrees with.
- ``"sampled"`` (a sampler with ``probs``, as :func:`mlx_spec.sampling.make_sampler` makes):
  drafters draw from ``sampler.probs`` and :func:`mlx_spec.accept_sampled` keeps draft tokens by
  rejection sampling, so the output has exactly the target's distribution.
- ``"match"`` (any other sampler): mlx-lm's rule, a draft token is kept when the target's own
  sample equals it; lossless, but it keeps few drafts at temperature > 0.

Drafters draw their tokens through :meth:`Rule.draw` and the loop verifies through
:meth:`Rule.decide`, so this is the one place that knows the three rules apart.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, partial
from typing import Any, Literal

import mlx.core as mx

from . import kernels
from .acceptance import _compile_per_thread, greedy_decision, greedy_token, sampled_decision
from .sampling import SpecSampler

__all__ = ["Rule", "make_rule"]

Sampler = Callable[[mx.array], mx.array]

_LM_GREEDY = importlib.import_module("mlx_lm.sample_utils").greedy_sampler


def _fit_vocab(rows: mx.array, vocab: int) -> mx.array:
    """A drafter's ``[n, V_d]`` distributions as ``[n, V]``: zero-padded, or cut to ``V``.

    Mass a draft puts on ids the target lacks is rejected anyway (an id >= ``V`` is never
    accepted), and the residual over the target's ids stays exact, so cutting is lossless.
    """
    have = rows.shape[-1]
    if have == vocab:
        return rows
    if have > vocab:
        return rows[:, :vocab]
    return mx.pad(rows, [(0, 0), (0, vocab - have)])


def _logprobs(logits: mx.array) -> mx.array:
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


@dataclass(frozen=True)
class Rule:
    """How draft tokens are drawn and verified under one sampler.

    A drafter gets it as ``setup.rule`` (:class:`mlx_spec.drafters.DraftSetup`): :meth:`draw`
    draws a token the way the generation's rule does, and :attr:`random` says whether it needs a
    key. The loop verifies through :meth:`decide`.

    Attributes:
        kind (str): ``"greedy"``, ``"sampled"`` or ``"match"``.
        sampler (callable, optional): the generation's sampler (``None`` for greedy).
    """

    kind: Literal["greedy", "sampled", "match"]
    sampler: Any = None

    @property
    def random(self) -> bool:
        """bool: whether drafting and verifying take keys (only rejection sampling does)."""
        return self.kind == "sampled"

    def draw(self, logits: mx.array, key: mx.array | None) -> tuple[mx.array, mx.array | None]:
        """A drafter's token after ``logits``, the way this rule drafts.

        Args:
            logits (array): ``[1, V_d]`` float logits of the drafter (after logits processors).
            key (array, optional): ``[2]`` uint32 key; used by ``"sampled"`` only.

        Returns:
            tuple: the ``[1]`` uint32 token and, for ``"sampled"``, the ``[1, V_d]`` float32
            distribution it was drawn from (``None`` otherwise); both lazy.
        """
        if self.kind == "greedy":
            return mx.argmax(logits, axis=-1).astype(mx.uint32), None
        if self.kind == "sampled":
            q = self.sampler.probs(_logprobs(logits))
            return mx.random.categorical(mx.log(q), key=key).astype(mx.uint32), q
        return self.sampler(_logprobs(logits)).astype(mx.uint32), None

    def decide(
        self,
        logits: mx.array,
        draft: mx.array,
        draft_probs: mx.array | None,
        eos: mx.array | None,
        key: mx.array | None,
        *,
        fused: bool,
        on_cpu: bool,
    ) -> tuple[mx.array, mx.array]:
        """The verification of one round, its arguments unchecked (the loop checks each
        proposal; see :func:`mlx_spec.acceptance.greedy_decision`).

        Args:
            logits (array): ``[N + 1, V]`` target logits (after logits processors).
            draft (array): ``[N]`` uint32 draft tokens.
            draft_probs (array, optional): ``[N, V_d]`` distributions the draft was drawn from
                (``None``: point masses); used by ``"sampled"`` only.
            eos (array, optional): ``[E]`` uint32 end-of-sequence ids.
            key (array, optional): ``[2]`` uint32 key; used by ``"sampled"`` only.
            fused (bool): decide with the fused CUDA kernels (where the vocabulary allows).
            on_cpu (bool): whether the default stream is on a CPU.

        Returns:
            tuple: the lazy ``[3]`` uint32 ``[accepted, next, eos_hit]`` and the ``[N + 1, V]``
            log-probabilities of each position.
        """
        logprobs = _logprobs(logits)
        if self.kind == "greedy":
            return greedy_decision(logits, draft, eos, fused=fused, on_cpu=on_cpu), logprobs
        if self.kind == "sampled":
            v = logits.shape[-1]
            q = None if draft_probs is None else _fit_vocab(draft_probs, v)
            probs = self.sampler.probs(logprobs)
            fused = fused and v <= kernels.MAX_VOCAB
            return sampled_decision(probs, draft, q, eos, key, fused=fused), logprobs
        # mlx-lm's rule: greedy acceptance of the one-hot rows of the target's own samples.
        picks = self.sampler(logprobs).astype(mx.uint32)
        one_hot = mx.arange(logits.shape[-1], dtype=mx.uint32)[None, :] == picks[:, None]
        rows = one_hot.astype(mx.float32)
        return greedy_decision(rows, draft, eos, fused=fused, on_cpu=on_cpu), logprobs

    def step(
        self, logits: mx.array, key: mx.array | None, *, fused: bool, on_cpu: bool
    ) -> tuple[mx.array, mx.array, mx.array]:
        """The token of a plain step (a round without a draft), as :meth:`decide` draws it.

        Args:
            logits (array): ``[1, V]`` float target logits (after logits processors).
            key (array, optional): ``[2]`` uint32 key; used by ``"sampled"`` only.
            fused (bool): decide with the fused CUDA kernels (where the rule has them).
            on_cpu (bool): whether the default stream is on a CPU.

        Returns:
            tuple: the lazy ``[1]`` uint32 token (:data:`mlx_spec.INVALID_ROW` where the row
            cannot decide), a ``[1]`` uint32 id to feed the model next (the token, or a valid
            id in place of a flagged one) and the ``[1, V]`` log-probabilities.
        """
        if self.kind == "greedy":
            token, fed = greedy_token(logits, on_cpu=on_cpu)
            return token, fed, _logprobs(logits)
        if isinstance(self.sampler, SpecSampler):
            # Its distribution is MLX operations alone: one compiled graph costs the host less
            # a step than building the same operations one at a time, and gives the same values.
            return _compiled_step(self, fused, on_cpu)(logits, key)
        return self._step(logits, key, fused=fused, on_cpu=on_cpu)

    def _step(
        self, logits: mx.array, key: mx.array | None, *, fused: bool, on_cpu: bool
    ) -> tuple[mx.array, mx.array, mx.array]:
        """:meth:`step` for the rules that draw: :meth:`decide` without a draft."""
        none = mx.array([], dtype=mx.uint32)
        result, logprobs = self.decide(logits, none, None, None, key, fused=fused, on_cpu=on_cpu)
        token = result[1:2]
        return token, mx.minimum(token, logits.shape[-1] - 1), logprobs


@cache
def _compiled_step(
    rule: Rule, fused: bool, on_cpu: bool
) -> Callable[[mx.array, mx.array | None], tuple[mx.array, mx.array, mx.array]]:
    """``rule``'s plain step compiled (in each thread; traced again for each vocabulary)."""
    return _compile_per_thread(partial(rule._step, fused=fused, on_cpu=on_cpu))


def make_rule(sampler: Any) -> Rule:
    """The rule for ``sampler`` (see the module's description).

    Args:
        sampler (callable, optional): maps ``[..., V]`` log-probabilities to tokens.

    Returns:
        Rule: the generation's rule.
    """
    if sampler is None or sampler is _LM_GREEDY or getattr(sampler, "greedy", False):
        return Rule("greedy")
    if callable(getattr(sampler, "probs", None)):
        return Rule("sampled", sampler)
    return Rule("match", sampler)
