"""The acceptance rule of a generation, decided once from its sampler.

- ``"greedy"`` (no sampler, a greedy sampler, or mlx-lm's greedy sampler): drafters take the
  argmax and :func:`mlx_spec.accept_greedy` keeps what the target's argmax agrees with.
- ``"coupled"`` (any other sampler; the default): the target's token at text position ``t`` is
  the sampler's draw with position ``t``'s random state (:mod:`mlx_spec.keys`), exactly as
  mlx-lm's plain sampling draws it under the same seed. A draft model draws its token at ``t``
  with the same state, and a draft token is kept while it equals the target's. The text is then
  plain sampling's, whatever the drafter, ``N`` or timing; a deterministic draft ``d`` is kept
  with probability ``p(d)``, and a draft model's tokens as often as the two draws agree.
- ``"residual"`` (a sampler with ``probs``, chosen explicitly): rejection sampling
  (:func:`mlx_spec.accept_sampled`): a draft model's token ``d`` drawn from ``q`` is kept with
  probability ``min(1, p(d) / q(d))``, else the next token is drawn from ``norm(max(p - q, 0))``;
  ``Σ min(p, q)`` is kept, and the output has exactly the target's distribution, but which text a
  key gives depends on how the rounds fall. Rounds without a draft, and plain steps, draw as
  ``"coupled"`` does.

A sampler with a ``logits`` method (:class:`mlx_spec.sampling.SpecSampler`, and mlx-lm's samplers
once :func:`mlx_spec.patch_mlx_lm` ran) draws as ``mx.random.categorical`` of those logits with
the position's key; any other sampler is called on each row with ``mx.random``'s global state set
to the position's state (it then draws as it would in mlx-lm's loop).

Drafters draw their tokens through :meth:`Rule.draw` and the loop verifies through
:meth:`Rule.decide`, so this is the one place that knows the rules apart.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

import mlx.core as mx

from . import _mlx_lm, kernels
from ._checks import INVALID_ROW
from .acceptance import (
    _argmax_rows,
    _compile_per_thread,
    _sizes,
    greedy_decision,
    greedy_token,
    matching_decision,
    sampled_decision,
)
from .keys import KeyChain, seed_of, set_global_state

__all__ = ["ACCEPTANCE", "Rule", "make_rule"]

Sampler = Callable[[mx.array], mx.array]

#: The rules a sampled generation may choose between.
ACCEPTANCE = ("coupled", "residual")


def _fit_vocab(rows: mx.array, vocab: int, fill: float = 0.0) -> mx.array:
    """A drafter's ``[n, V_d]`` rows as ``[n, V]``: padded with ``fill``, or cut to ``V``.

    Mass a draft puts on ids the target lacks is rejected anyway (an id >= ``V`` is never
    accepted), and the residual over the target's ids stays exact, so cutting is lossless.
    """
    have = rows.shape[-1]
    if have == vocab:
        return rows
    if have > vocab:
        return rows[:, :vocab]
    return mx.pad(rows, [(0, 0), (0, vocab - have)], constant_values=fill)


def _normalised(logits: mx.array) -> tuple[mx.array, mx.array]:
    """The ``[n, V]`` log-probabilities of ``[n, V]`` float ``logits``, and their ``[n, 1]``
    log-sum-exp (for :func:`_undecided`)."""
    total = mx.logsumexp(logits, axis=-1, keepdims=True)
    return logits - total, total


def _undecided(total: mx.array) -> mx.array:
    """``[n]`` bool: the rows that are no distribution to draw from (a NaN, a +inf, or no finite
    logit), those whose log-sum-exp ``total`` (``[n, 1]``, from :func:`_normalised`) is not
    finite; where it is, every log-probability is finite or -inf."""
    return ~mx.isfinite(total[..., 0])


@dataclass(frozen=True)
class Rule:
    """How draft tokens are drawn and verified under one sampler.

    A drafter gets it as ``setup.rule`` (:class:`mlx_spec.drafters.DraftSetup`): :meth:`draw`
    draws a token the way the generation's rule does, and :attr:`random` says whether it needs a
    key. The loop verifies through :meth:`decide`.

    Attributes:
        kind (str): ``"greedy"``, ``"coupled"`` or ``"residual"``.
        sampler (callable, optional): the generation's sampler (``None`` for greedy).
        steps (int): the keys one call of the sampler draws from ``mx.random``'s sequence (how
            far apart the states of consecutive positions are). Default: ``1``.
        vocab (int, optional): the target's vocabulary: a coupled draft is drawn over the same
            ids as the target's token (a drafter's row padded with ``-inf`` or cut). Default:
            the drafter's own.
    """

    kind: Literal["greedy", "coupled", "residual"]
    sampler: Any = None
    steps: int = 1
    vocab: int | None = None

    @property
    def random(self) -> bool:
        """bool: whether drafting and verifying take keys (every rule but greedy)."""
        return self.kind != "greedy"

    @property
    def seeds(self) -> bool:
        """bool: whether draws set ``mx.random``'s global state (a sampler that exposes neither
        ``logits`` nor ``probs`` is called with the position's state there)."""
        return self.kind == "coupled" and not _draws_categorical(self.sampler)

    def keys(self, chain: KeyChain, position: int, n: int, *, draft: bool) -> mx.array | None:
        """The randomness of a round from text position ``position`` with ``n`` draft tokens.

        Args:
            chain (KeyChain): the generation's states.
            position (int): the text position of the round's first new token.
            n (int): its draft tokens.
            draft (bool): the drafter's keys (``[n, 2]``, one per drafted token) rather than the
                verification's (``[N + 1, 2]`` for ``"coupled"``, a ``[2]`` key for
                ``"residual"``).

        Returns:
            array: uint32 keys, or ``None`` for greedy. A coupled draw takes its position's key
            (:meth:`mlx_spec.keys.KeyChain.keys`), or its state where the sampler is called with
            ``mx.random``'s state set (:attr:`seeds`).
        """
        if self.kind == "greedy":
            return None
        if self.kind == "coupled" or n == 0:
            return self.position_keys(chain, position, n if draft else n + 1)
        drafting, verifying = mx.random.split(chain.keys(position, 1)[0])
        return mx.random.split(drafting, n) if draft else verifying

    def position_keys(self, chain: KeyChain, position: int, count: int) -> mx.array:
        """``[count, 2]`` uint32: the keys of the draws at ``count`` text positions from
        ``position``, each taking its own (a coupled draw's, or a plain step's under any rule but
        greedy): its key, or its state where the sampler is called with ``mx.random``'s state
        set (:attr:`seeds`)."""
        return (chain.states if self.seeds else chain.keys)(position, count)

    def draw(self, logits: mx.array, key: mx.array | None) -> tuple[mx.array, mx.array | None]:
        """A drafter's token after ``logits``, the way this rule drafts.

        Args:
            logits (array): ``[1, V_d]`` float logits of the drafter (after logits processors).
            key (array, optional): ``[2]`` uint32, the key :meth:`keys` gave the token's
                position; unused by greedy.

        Returns:
            tuple: the ``[1]`` uint32 token and, for ``"residual"``, the ``[1, V_d]`` float32
            distribution it was drawn from (``None`` otherwise); both lazy.
        """
        if self.kind == "greedy":
            return mx.argmax(logits, axis=-1).astype(mx.uint32), None
        if self.kind == "residual":
            q = self.sampler.probs(_normalised(logits)[0])
            return mx.random.categorical(mx.log(q), key=key).astype(mx.uint32), q
        if self.vocab is not None:
            logits = _fit_vocab(logits, self.vocab, -mx.inf)
        return self._coupled(_normalised(logits)[0], key[None]), None

    def _coupled(self, logprobs: mx.array, keys: mx.array) -> mx.array:
        """``[n]`` uint32: row ``i`` of ``logprobs`` (``[n, V]``) drawn with ``keys[i]`` (see
        :meth:`keys`)."""
        if _draws_categorical(self.sampler):
            form, inputs = _graph_of(self.sampler, logprobs)
            return _coupled_graph(form)(logprobs, keys, *inputs)
        tokens = []
        for row, state in zip(logprobs, keys.tolist(), strict=True):
            set_global_state(mx.array(state, dtype=mx.uint32))
            tokens.append(self.sampler(row[None]).reshape(1).astype(mx.uint32))
        return mx.concatenate(tokens)

    def decide(
        self,
        logits: mx.array,
        draft: mx.array,
        draft_probs: mx.array | None,
        eos: mx.array | None,
        keys: mx.array | None,
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
                (``None``: point masses); used by ``"residual"`` only.
            eos (array, optional): ``[E]`` uint32 end-of-sequence ids.
            keys (array, optional): the verification's keys from :meth:`keys`.
            fused (bool): decide with the fused CUDA kernels (where the vocabulary allows).
            on_cpu (bool): whether the default stream is on a CPU.

        Returns:
            tuple: the lazy ``[3]`` uint32 ``[accepted, next, eos_hit]`` and the ``[N + 1, V]``
            log-probabilities of each position.
        """
        logprobs, total = _normalised(logits)
        if self.kind == "greedy":
            return greedy_decision(logits, draft, eos, fused=fused, on_cpu=on_cpu), logprobs
        if self.kind == "residual" and draft.size:
            v = logits.shape[-1]
            q = None if draft_probs is None else _fit_vocab(draft_probs, v)
            probs = self.sampler.probs(logprobs)
            fused = fused and v <= kernels.MAX_VOCAB
            return sampled_decision(probs, draft, q, eos, keys, fused=fused), logprobs
        tokens = self._coupled(logprobs, keys)
        return matching_decision(tokens, _undecided(total), draft, eos), logprobs

    def choices(
        self, logits: mx.array, keys: mx.array | None, *, on_cpu: bool, draft: bool = False
    ) -> tuple[mx.array, mx.array]:
        """The token this rule takes at each row on its own, before any draft is compared with
        it: what :meth:`decide` keeps draft tokens against (the target's rows), or what
        :meth:`draw` drafts (``draft=True``). A batch draws so for all its sequences that share
        a rule at once, each row with its own position's key.

        Args:
            logits (array): ``[k, V]`` float logits, the target's, or a drafter's with
                ``draft`` (drawn over the target's ids, as :meth:`draw` draws them).
            keys (array, optional): ``[k, 2]`` uint32, each row's key from :meth:`keys`;
                unused by greedy.
            on_cpu (bool): whether the default stream is on a CPU.
            draft (bool): the rows are a drafter's. Default: ``False``.

        Returns:
            tuple: the lazy ``[k]`` uint32 tokens and ``[k]`` bool rows that cannot decide.

        Raises:
            ValueError: the rule is ``"residual"``, whose target has no token of its own a row.
        """
        if self.kind == "residual":
            raise ValueError(
                "Rule.choices: the residual rule draws no token of its own per row, got kind "
                "'residual'"
            )
        if self.kind == "greedy":
            return _argmax_rows(logits, on_cpu)
        if draft and self.vocab is not None:
            logits = _fit_vocab(logits, self.vocab, -mx.inf)
        logprobs, total = _normalised(logits)
        return self._coupled(logprobs, keys), _undecided(total)

    def step(
        self, logits: mx.array, key: mx.array | None, *, on_cpu: bool
    ) -> tuple[mx.array, mx.array, mx.array]:
        """The token of a plain step (a round without a draft), as :meth:`decide` draws it, for
        one sequence or for each row of a batch under this rule.

        Args:
            logits (array): ``[k, V]`` float target logits (after logits processors).
            key (array, optional): ``[k, 2]`` uint32, each row's key from :meth:`keys` (unused by
                greedy).
            on_cpu (bool): whether the default stream is on a CPU.

        Returns:
            tuple: the lazy ``[k]`` uint32 tokens (:data:`mlx_spec.INVALID_ROW` where a row
            cannot decide), ``[k]`` uint32 ids to feed the model next (the token, or a valid
            id in place of a flagged one) and the ``[k, V]`` log-probabilities.
        """
        if self.kind == "greedy":
            token, fed = greedy_token(logits, on_cpu=on_cpu)
            return token, fed, _normalised(logits)[0]
        if _draws_categorical(self.sampler):
            # One compiled graph a step: plain steps run where host work is most of a token.
            last_id = _sizes(logits.shape[-1], 0).last_id
            form, inputs = _graph_of(self.sampler, logits)
            return _coupled_step_graph(form)(logits, key, last_id, *inputs)
        logprobs, total = _normalised(logits)
        token = mx.where(_undecided(total), INVALID_ROW, self._coupled(logprobs, key))
        return token, mx.minimum(token, logits.shape[-1] - 1), logprobs


def _draws_categorical(sampler: Any) -> bool:
    """Whether ``sampler`` exposes what it draws from: ``logits`` (the scores of its
    ``mx.random.categorical`` draw) or ``probs``."""
    return callable(getattr(sampler, "logits", None)) or callable(getattr(sampler, "probs", None))


def _graph_of(sampler: Any, rows: mx.array) -> tuple[Any, tuple[mx.array, ...]]:
    """What a compiled draw under ``sampler`` on rows like ``rows`` (``[k, V]``) is made from,
    and the inputs it takes besides them: for a sampler with a ``form``
    (:class:`mlx_spec.sampling.SpecSampler`), its form and its parameters, so that samplers
    differing only in their values share one graph and its kernels; for any other, the sampler
    itself and none."""
    if callable(getattr(sampler, "form", None)) and callable(getattr(sampler, "inputs", None)):
        return sampler.form(rows), sampler.inputs(rows)
    return sampler, ()


def _scores(sampler: Any, logprobs: mx.array, *inputs: mx.array) -> mx.array:
    """The scores ``sampler`` (or a :class:`mlx_spec.sampling.SamplerForm` with its ``inputs``)
    draws a categorical from: its ``logits``, or its ``probs``' log."""
    logits = getattr(sampler, "logits", None)
    return logits(logprobs, *inputs) if callable(logits) else mx.log(sampler.probs(logprobs))


@lru_cache(maxsize=32)
def _coupled_graph(sampler: Any) -> Callable[..., mx.array]:
    """``(logprobs [n, V], keys [n, 2], *inputs) -> [n]`` uint32: each row drawn as mlx-lm's
    sampler draws a ``[1, V]`` row with that key (compiled per thread); ``sampler`` and
    ``inputs`` as :func:`_graph_of` gives them."""

    together = _mlx_lm.rows_by_inverse_cdf()  # probed here, outside the traced function

    def coupled(logprobs: mx.array, keys: mx.array, *inputs: mx.array) -> mx.array:
        return _draw_rows(_scores(sampler, logprobs, *inputs), keys, together)

    return _compile_per_thread(coupled)


def _draw_rows(scores: mx.array, keys: mx.array, together: bool) -> mx.array:
    """``[n]`` uint32: each row of ``scores`` (``[n, V]``) drawn as ``mx.random.categorical``
    draws a ``[1, V]`` row with that row's key (``keys``: ``[n, 2]``): all rows in one graph
    where ``together`` (:func:`mlx_spec._mlx_lm.rows_by_inverse_cdf`), else one draw a row."""
    if together and scores.shape[0] > 1:
        return _mlx_lm.categorical_rows(scores, keys)
    tokens = [mx.random.categorical(scores[i : i + 1], key=keys[i]) for i in range(scores.shape[0])]
    return mx.concatenate(tokens).astype(mx.uint32)


@lru_cache(maxsize=32)
def _coupled_step_graph(sampler: Any) -> Callable[..., tuple[mx.array, mx.array, mx.array]]:
    """``(logits [k, V], keys [k, 2], last_id [], *inputs) -> (tokens, fed, logprobs)``: a
    plain step's draws (see :meth:`Rule.step`), compiled per thread; ``last_id`` is ``V - 1`` as
    an input (see :class:`mlx_spec.acceptance._Sizes`), ``sampler`` and ``inputs`` as
    :func:`_graph_of` gives them."""

    together = _mlx_lm.rows_by_inverse_cdf()  # probed here, outside the traced function

    def step(
        logits: mx.array, keys: mx.array, last_id: mx.array, *inputs: mx.array
    ) -> tuple[mx.array, mx.array, mx.array]:
        logprobs, total = _normalised(logits)
        drawn = _draw_rows(_scores(sampler, logprobs, *inputs), keys, together)
        token = mx.where(_undecided(total), INVALID_ROW, drawn)
        return token, mx.minimum(token, last_id), logprobs

    return _compile_per_thread(step)


#: The probe row's width where the vocabulary is not known: wider than any top-k one would use.
_PROBE_WIDTH = 2**17


def _keys_per_call(sampler: Sampler, vocab: int | None) -> int:
    """How many keys of ``mx.random``'s sequence one call of ``sampler`` draws (mlx-lm's
    categorical draws one; with XTC, two): found by calling it once on a uniform row as wide as
    the vocabulary (mlx-lm's top-k refuses a ``k`` not below the row's width), ``mx.random``'s
    state put back after. ``1`` where none of one to four matches (a sampler with keys of its
    own): the text is then still reproducible, but not mlx-lm's."""
    width = vocab or _PROBE_WIDTH
    saved = mx.random.state[0]
    probe = mx.random.key(0)
    try:
        set_global_state(probe)
        sampler(mx.full((1, width), -math.log(width)))
        after = mx.random.state[0]
        state = probe
        for steps in range(1, 5):
            state = mx.random.split(state)[0]
            if seed_of(state) == seed_of(after):
                return steps
        return 1
    finally:
        set_global_state(saved)


def make_rule(sampler: Any, acceptance: str = "coupled", vocab: int | None = None) -> Rule:
    """The rule for ``sampler`` (see the module's description).

    Args:
        sampler (callable, optional): maps ``[..., V]`` log-probabilities to tokens.
        acceptance (str): ``"coupled"`` or ``"residual"`` for a sampler that samples;
            ``"residual"`` needs one with ``probs``. Default: ``"coupled"``.
        vocab (int, optional): the target's vocabulary (see :attr:`Rule.vocab`).

    Returns:
        Rule: the generation's rule.

    Raises:
        ValueError: ``acceptance`` is not one of :data:`ACCEPTANCE`, or ``"residual"`` with a
            sampler without ``probs``.
    """
    if acceptance not in ACCEPTANCE:
        raise ValueError(
            f"speculative_generate_step: `acceptance` must be one of {ACCEPTANCE}, got "
            f"{acceptance!r}"
        )
    if sampler is None or _mlx_lm.is_greedy_sampler(sampler) or getattr(sampler, "greedy", False):
        return Rule("greedy")
    if acceptance == "residual":
        if not callable(getattr(sampler, "probs", None)):
            raise ValueError(
                "speculative_generate_step: `acceptance='residual'` needs a sampler with `probs` "
                "(mlx_spec.make_sampler, or mlx-lm's after patch_mlx_lm()), got "
                f"{type(sampler).__name__}"
            )
        return Rule("residual", sampler, vocab=vocab)
    steps = 1 if _draws_categorical(sampler) else _keys_per_call(sampler, vocab)
    return Rule("coupled", sampler, steps, vocab)
