"""Speculative decoding for many sequences at once, as mlx-lm's batched generation runs them.

mlx-lm's ``GenerationBatch`` feeds every sequence of a batch one token per target call. A
:class:`SpeculativeBatch` runs rounds instead. Each sequence drafts for itself (its own prompt
lookup index, or its rows of a draft model run as a batch on batch caches of its own) up to its
own draft length, which may be 0. A round then makes:

1. one target call over ``[B, 1 + N]`` positions: each row's last token and its drafts, right
   padded to the longest draft ``N``;
2. the decision for every row at once, as one lazy graph (:func:`decide`);
3. one host read of the decisions and the drafts;
4. per-row rollback: each row of the batch caches is taken back to its own kept length
   (:class:`mlx_spec.batch_caches.BatchCaches`: attention layers drop their newest entries, the
   gated delta-net layers of hybrids take the states the call kept after each position).

A row emits its kept drafts and the target's token after them, cut at an EOS or at its
``max_tokens`` as mlx-lm cuts it. Each sequence has its own sampler, and with it its own rule
(:mod:`mlx_spec.rules`): greedy keeps a draft token while it equals the target's argmax at its
position; coupled, while it equals the target's draw with that position's state of the
sequence's own key (:mod:`mlx_spec.keys`), which a draft model's draw at that position shares.
A sequence's tokens are then what :func:`mlx_spec.speculative_generate_step` gives it alone
with the same sampler and key, whatever the batch around it and the draft lengths.

:class:`SpeculativeBatchGenerator` is the counterpart of mlx-lm's ``BatchGenerator``: sequences
join and leave a running :class:`SpeculativeBatch` between its rounds.
"""

from __future__ import annotations

import copy
import time
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.generate import BatchResponse, GenerationBatch, PromptProcessingBatch
from mlx_lm.generate_utils import BatchCounters, BatchCountersSnapshot, BatchStats
from mlx_lm.models.cache import make_prompt_cache

from . import _mlx_lm
from ._checks import check_callable, check_int, check_key, device_type, is_int
from .acceptance import INVALID_ROW, _argmax_rows, _compile_per_thread, _matching, check_next
from .batch_caches import BatchCaches, cache_kinds, check_batchable, held, held_tokens
from .batch_length import BatchAdaptive
from .batch_mtp import BatchHead, Capturing, check_head
from .draft_length import MAX_DRAFT_TOKENS, Adaptive, Outcome, Round
from .drafters import Drafter, DraftSetup, PromptLookupDrafter
from .keys import BLOCK, KeyChain, set_global_state
from .loop import Text, vocab_size
from .mtp import MTPDrafter
from .rules import Rule, make_rule

__all__ = ["SpeculativeBatch", "SpeculativeBatchGenerator", "batch_generate", "decide"]

#: A draft id no target token equals: it fills the draft columns a row does not use.
NO_DRAFT = 2**32 - 1

Response = GenerationBatch.Response


def _match_rows(
    choice: mx.array, invalid: mx.array, drafts: mx.array, eos: mx.array | None
) -> mx.array:
    rows = mx.vmap(lambda c, i, d: _matching(c, i, d, eos))
    return rows(choice, invalid, drafts)


def _decide(logits: mx.array, drafts: mx.array, eos: mx.array | None) -> mx.array:
    b, w, v = logits.shape
    on_cpu = device_type(None) == mx.cpu
    choice, invalid = _argmax_rows(logits.reshape(b * w, v), on_cpu)
    return _match_rows(choice.reshape(b, w), invalid.reshape(b, w), drafts, eos)


_decide_graph = _compile_per_thread(_decide)
_match_rows_graph = _compile_per_thread(_match_rows)


def decide(logits: mx.array, drafts: mx.array, eos: mx.array | None) -> mx.array:
    """Greedy acceptance for every row of a batch at once, unchecked.

    Args:
        logits (array): ``[B, N + 1, V]`` float target logits of the round.
        drafts (array): ``[B, N]`` uint32 draft tokens; :data:`NO_DRAFT` past a row's own
            draft, so that nothing there is kept.
        eos (array, optional): ``[E]`` uint32 end-of-sequence ids, ``E >= 1``; ``None`` for none.

    Returns:
        array: lazy ``[B, 3]`` uint32, each row :func:`mlx_spec.accept_greedy`'s
        ``[accepted, next, eos_hit]`` for that row.
    """
    return _decide_graph(logits, drafts, eos)


def _groups(rules: list[Rule]) -> list[tuple[Rule, list[int]]]:
    """The rows of each distinct rule, in order of first appearance."""
    rows: dict[Rule, list[int]] = {}
    for i, rule in enumerate(rules):
        rows.setdefault(rule, []).append(i)
    return list(rows.items())


def choices(
    logits: mx.array,
    rules: list[Rule],
    states: list[mx.array | None],
    *,
    draft: bool = False,
) -> tuple[mx.array, mx.array]:
    """Each row's own tokens under its own rule (:meth:`mlx_spec.rules.Rule.choices`), the rows
    that share a rule drawn together.

    Args:
        logits (array): ``[B, W, V]`` float logits, the target's or (``draft``) a drafter's.
        rules (list of Rule): each row's rule, greedy or coupled.
        states (list): each row's ``[W, 2]`` uint32 states (``None`` for greedy rows).
        draft (bool): the logits are a drafter's. Default: ``False``.

    Returns:
        tuple: lazy ``[B, W]`` uint32 tokens and ``[B, W]`` bool rows that cannot decide.
    """
    b, w, v = logits.shape
    on_cpu = device_type(None) == mx.cpu
    tokens, invalid, order = [], [], []
    for rule, rows in _groups(rules):
        picked = logits if len(rows) == b else logits[mx.array(rows)]
        keys = mx.concatenate([states[i] for i in rows]) if rule.random else None
        chosen, bad = rule.choices(picked.reshape(-1, v), keys, on_cpu=on_cpu, draft=draft)
        tokens.append(chosen.reshape(len(rows), w))
        invalid.append(bad.reshape(len(rows), w))
        order.extend(rows)
    if len(tokens) == 1:
        return tokens[0], invalid[0]
    back = mx.array(np.argsort(order))
    return mx.concatenate(tokens)[back], mx.concatenate(invalid)[back]


def decide_drawn(
    choice: mx.array, invalid: mx.array, drafts: mx.array, eos: mx.array | None
) -> mx.array:
    """:func:`decide` for tokens already chosen (:func:`choices`): each row keeps its drafts
    while they equal its own tokens, unchecked.

    Args:
        choice (array): ``[B, N + 1]`` uint32, each row's token at each position.
        invalid (array): ``[B, N + 1]`` bool, positions that cannot decide.
        drafts (array): ``[B, N]`` uint32 drafts, :data:`NO_DRAFT` past a row's own.
        eos (array, optional): ``[E]`` uint32 end-of-sequence ids; ``None`` for none.

    Returns:
        array: lazy ``[B, 3]`` uint32 ``[accepted, next, eos_hit]`` per row.
    """
    return _match_rows_graph(choice, invalid, drafts, eos)


@dataclass
class _Sequence:
    """One sequence of a batch.

    Attributes:
        uid (int): its id, as mlx-lm's ``BatchGenerator`` numbers sequences.
        text (Text): its prompt and the tokens emitted so far.
        drafter (Drafter, optional): its own prompt lookup (``None`` with a draft model).
        draft_length (int): the most draft tokens a round.
        max_tokens (int): the tokens it may emit.
        rule (Rule): how its tokens are drawn and verified (greedy or coupled).
        keys (KeyChain, optional): the random state of each of its text positions (``None``
            for greedy).
        estimate (Adaptive, optional): its acceptance estimate, with adaptive lengths.
        lag (int): tokens before the text's last that the draft model's caches lack.
        cap (int): the most it may draft next round (its budget, or its proposal's length).
        draft (list of int): its prompt lookup proposal for the next round.
        label (int): that proposal's kind (:attr:`mlx_spec.drafters.Draft.label`).
        stop (StopSequences.Matcher, optional): mlx-lm's matcher of its stop sequences, which
            end it at their last token (``None``: the batch's EOS ids do).
        processors (list): its logits processors, ``processor(tokens, logits)`` as mlx-lm calls
            them, applied to its target logits at each position given its text up to there.
        seen (int): with an MTP head, the text position from which the head has not seen its
            target's hidden states.
        hidden (list of array): those hidden states, ``[k, H]`` arrays in text order.
    """

    uid: int
    text: Text
    drafter: Drafter | None
    draft_length: int
    max_tokens: int
    rule: Rule
    keys: KeyChain | None
    estimate: Adaptive | None = None
    lag: int = 0
    cap: int = 0
    draft: list[int] = field(default_factory=list)
    label: int = 0
    stop: Any = None
    processors: list[Any] = field(default_factory=list)
    seen: int = 0
    hidden: list[mx.array] = field(default_factory=list)

    def ends(self, token: int, eos: set[int]) -> bool:
        """Whether ``token``, just emitted, ends the sequence with finish reason ``"stop"``."""
        return self.stop.advance(token) if self.stop is not None else token in eos

    def budget(self) -> int:
        """The draft tokens a round may verify: a round emits at most that many and one more."""
        return max(0, min(self.draft_length, self.max_tokens - self.text.position - 1))

    def states(self, n: int, *, draft: bool, ahead: int = 0) -> mx.array | None:
        """The keys of a round ``ahead`` tokens from here with ``n`` drafts (:meth:`Rule.keys`):
        ``[n, 2]`` for the drafts, ``[n + 1, 2]`` for the verification; ``None`` for greedy."""
        if self.keys is None:
            return None
        return self.rule.keys(self.keys, self.text.position + ahead, n, draft=draft)


def _padded(rows: list[list[int]], width: int, fill: int) -> mx.array:
    """``[len(rows), width]`` uint32: each row followed by ``fill``."""
    return mx.array([row + [fill] * (width - len(row)) for row in rows], dtype=mx.uint32)


def _prefill(
    model: nn.Module,
    prompts: list[list[int]],
    step: int,
    started: list[list[Any] | None],
    capture: Capturing | None = None,
) -> tuple[list[Any], list[int], list[mx.array]]:
    """The batch caches of ``model`` holding each prompt but its last token, filled as mlx-lm's
    ``BatchGenerator`` fills them (right padded, then each row moved behind left padding), each
    row from its ``started`` caches where given (which hold the prompt's first tokens); how many
    tokens each row's started caches held; and with ``capture`` (the target, called by it) each
    row's ``[k, H]`` hidden states of the positions filled."""
    caches = [c if c is not None else make_prompt_cache(model) for c in started]
    done = [held(c) if c else 0 for c in caches]
    batch = PromptProcessingBatch(
        capture or model, list(range(len(prompts))), caches, prefill_step_size=step
    )
    rows = [p[h:-1] for p, h in zip(prompts, done, strict=True)]
    if any(rows):
        batch.prompt(rows)
    states = capture.rows([len(r) for r in rows]) if capture is not None else []
    return batch.prompt_cache, done, states


def _split_started(
    op: str,
    started: list[list[Any] | None],
    prompts: list[list[int]],
    model: nn.Module,
    draft_model: nn.Module | None,
) -> tuple[list[list[Any] | None], list[list[Any] | None]]:
    """Each row's caches to start from split into the target's layers and the draft model's,
    after checking them (:func:`held_tokens`)."""
    kinds = cache_kinds(model, draft_model)
    layers = len(cache_kinds(model))
    for i, (caches, prompt) in enumerate(zip(started, prompts, strict=True)):
        if caches is not None and held_tokens(caches, kinds, len(prompt)) is None:
            raise ValueError(
                f"{op}: `prompt_caches[{i}]` must be None or caches of "
                f"{[kind.__name__ for kind in kinds]} (the target's, then the draft model's) "
                f"holding one length, less than its prompt's {len(prompt)} tokens"
            )
    return (
        [c[:layers] if c is not None else None for c in started],
        [c[layers:] if c is not None else None for c in started],
    )


class SpeculativeBatch:
    """A batch of sequences decoded speculatively together: the counterpart of mlx-lm's
    ``GenerationBatch``, whose :meth:`next` runs one round and returns each emitted token as a
    ``GenerationBatch.Response``.

    Args:
        model (nn.Module): the target model; its caches must batch
            (:func:`mlx_spec.batch_caches.check_batchable`: ``KVCache`` layers, and the gated
            delta-net layers of hybrids).
        prompts (list of list of int): each sequence's prompt, non-empty.
        draft_lengths (list of int): each sequence's most draft tokens a round, ``>= 0``.
        max_tokens (list of int): each sequence's tokens to emit, ``>= 1``.
        eos_token_ids (list of int): ids that end a sequence (emitted, finish reason ``"stop"``).
        samplers (list, optional): each sequence's sampler (``None``: greedy); one that samples
            takes the coupled rule. Default: all greedy.
        keys (list, optional): each sequence's ``[2]`` uint32 key, its random state before its
            first generated token (``None`` for a greedy one). Needed by every sequence that
            samples.
        draft_model (nn.Module, optional): drafts for every sequence, run as a batch.
        drafter (Drafter, optional): a prompt lookup drafter, each sequence getting its own
            copy; or an :class:`mlx_spec.MTPDrafter` whose head drafts for every sequence
            (:class:`mlx_spec.batch_mtp.BatchHead`).
        prefill_step_size (int): prompt tokens per prefill call. Default: ``2048``.
        return_prompt_caches (bool): give each finished sequence's caches in its last response
            (one model call each, for the tokens a round leaves unfed). Default: ``False``.
        policy (BatchAdaptive, optional): chooses each round's ``N``, each sequence drafting up
            to ``min(N, draft_lengths[i])``; keep one across batches to keep what it measured.
            Default: none, each sequence drafting ``draft_lengths[i]`` a round.
        uids (list of int, optional): each sequence's id in responses. Default: ``0 .. B - 1``.
        prompt_caches (list, optional): for each sequence ``None`` or the caches to start it
            from, as :attr:`mlx_lm.generate.GenerationBatch.Response.prompt_cache` gives them:
            caches of the target's layers, then of the draft model's, all holding the
            prompt's first tokens (fewer than all). Default: none.
        stop_sequences (list, optional): for each sequence mlx-lm's ``StopSequences``, whose
            match ends it (finish reason ``"stop"``) instead of ``eos_token_ids``. Default: none.
        logits_processors (list, optional): for each sequence a list of logits processors
            (``processor(tokens, logits)``, as mlx-lm's ``make_logits_processors`` makes them),
            applied to its target logits at every position, as mlx-lm's ``GenerationBatch``
            applies them. Default: none.
    """

    def __init__(
        self,
        model: nn.Module,
        prompts: list[list[int]],
        draft_lengths: list[int],
        max_tokens: list[int],
        eos_token_ids: list[int],
        samplers: list[Any] | None = None,
        keys: list[mx.array | None] | None = None,
        *,
        draft_model: nn.Module | None = None,
        drafter: Drafter | None = None,
        prefill_step_size: int = 2048,
        return_prompt_caches: bool = False,
        policy: BatchAdaptive | None = None,
        uids: list[int] | None = None,
        prompt_caches: list[list[Any] | None] | None = None,
        stop_sequences: list[Any] | None = None,
        logits_processors: list[list[Any]] | None = None,
    ) -> None:
        count = len(prompts)
        started, started_drafts = _split_started(
            "SpeculativeBatch", prompt_caches or [None] * count, prompts, model, draft_model
        )
        self.model = model
        self.policy = policy
        self.draft_model = draft_model
        self.vocab = vocab_size(model)
        self.eos = set(eos_token_ids)
        self._eos = mx.array(eos_token_ids, dtype=mx.uint32) if eos_token_ids else None
        self.return_prompt_caches = return_prompt_caches
        rules = [make_rule(s, "coupled", self.vocab) for s in samplers or [None] * count]
        lookup = None if isinstance(drafter, MTPDrafter) else drafter
        self.sequences = [
            _sequence(uid, prompt, lookup, n, most, rule, key, policy, stop, processors)
            for uid, prompt, n, most, rule, key, stop, processors in zip(
                uids if uids is not None else range(count),
                prompts,
                draft_lengths,
                max_tokens,
                rules,
                keys or [None] * count,
                stop_sequences or [None] * count,
                logits_processors or [[]] * count,
                strict=True,
            )
        ]
        # A sampler that exposes no distribution is called with mx.random's global state set
        # to each position's (as single-sequence generation calls it); a round puts it back.
        self._seeds = any(rule.seeds for rule in rules)
        # With an MTP head, the target's calls keep their hidden states, which it reads.
        mtp = isinstance(drafter, MTPDrafter)
        split = _mlx_lm.split(model) if mtp else None
        self.head = BatchHead(model, drafter.head, count) if mtp else None
        layers, done, states = _prefill(
            model, prompts, prefill_step_size, started, Capturing(split) if mtp else None
        )
        self.cache = BatchCaches(model, layers, split=split)
        if mtp:
            for s, start, rows in zip(self.sequences, done, states, strict=True):
                s.seen, s.hidden = start, [rows] if rows.size else []
        self.draft_cache = (
            BatchCaches(
                draft_model, _prefill(draft_model, prompts, prefill_step_size, started_drafts)[0]
            )
            if draft_model is not None
            else None
        )
        self.rounds = 0
        # The plain step started and not yet read, whether another follows it, and the time of
        # the last read.
        self._ahead: tuple[mx.array, mx.array, mx.array, mx.array | None] | None = None
        self._more = False
        # Plain steps' keys (_step_keys): the rows' uids and positions, and the table made.
        self._keys: tuple[list[int], list[int], mx.array] | None = None
        self._first = False
        self._clock = 0.0

    def __len__(self) -> int:
        return len(self.sequences)

    def _plan(self) -> int:
        """The next round's ``N`` (``0``: a plain step); each row's ``cap`` and, with prompt
        lookup, its proposal are set on the row."""
        for s in self.sequences:
            budget = s.budget()
            s.draft, s.label = [], 0
            if s.drafter is not None and budget:
                keys = s.states(budget, draft=True) if s.drafter.reads_keys else None
                proposal = s.drafter.propose(s.text, budget, keys)
                s.draft, s.label = proposal.tokens.tolist(), proposal.label
            s.cap = len(s.draft) if s.drafter is not None else budget
            if self.head is not None and not s.hidden:
                s.cap = 0  # the head has no position to draft from (a one-token prompt)
        if self.policy is None:
            return max(s.cap for s in self.sequences)
        return self.policy.choose([(s.estimate, Round(s.cap, s.label)) for s in self.sequences])

    def _proposals(self, n: int) -> mx.array:
        """``[B, n]`` uint32: each row's draft of ``min(n, cap)`` tokens, then
        :data:`NO_DRAFT`."""
        own = [min(n, s.cap) for s in self.sequences]
        if self.draft_model is not None or self.head is not None:
            drafts = self._draft_with_model(n) if self.head is None else self._draft_with_head(n)
            used = mx.array(np.arange(n)[None] < np.array(own)[:, None])
            return mx.where(used, drafts, NO_DRAFT).astype(mx.uint32)
        return _padded([s.draft[:k] for s, k in zip(self.sequences, own, strict=True)], n, NO_DRAFT)

    def _drawer(self, n: int) -> Any:
        """``draw(logits [B, 1, V], j) -> [B]`` uint32: draft step ``j`` of ``n``, each row
        drawn under its own rule with its own position's state."""
        rules = [s.rule for s in self.sequences]
        states = [s.states(n, draft=True) for s in self.sequences]

        def draw(last: mx.array, j: int) -> mx.array:
            at_j = [None if k is None else k[j : j + 1] for k in states]
            return choices(last, rules, at_j, draft=True)[0][:, 0]

        return draw

    def _draft_with_head(self, n: int) -> mx.array:
        """``[B, n]`` uint32: the MTP head's tokens after each row's text, lazy
        (:meth:`BatchHead.draft`), from the hidden states it had not seen."""
        counts = [sum(h.shape[0] for h in s.hidden) for s in self.sequences]
        after = [
            s.text.ids(s.seen + 1, s.seen + 1 + k)
            for s, k in zip(self.sequences, counts, strict=True)
        ]
        first = [s.seen == 0 for s in self.sequences]
        hidden = [s.hidden for s in self.sequences]
        tokens = self.head.draft(hidden, after, first, n, self._drawer(n))
        for s, k in zip(self.sequences, counts, strict=True):
            s.seen, s.hidden = s.seen + k, []
        return tokens

    def _draft_with_model(self, n: int) -> mx.array:
        """``[B, n]`` uint32: the draft model's tokens after each row's text, lazy, each row's
        drawn under its own rule with its own position's state. Its caches then hold each row's
        text and ``n - 1`` drafts, as if no row lagged."""
        lags = [s.lag for s in self.sequences]
        width = max(lags) + 1
        rows = [s.text.ids(len(s.text) - s.lag - 1) for s in self.sequences]
        logits = self.draft_cache(_padded(rows, width, 0), undoable=True)
        at = mx.array(lags)[:, None, None]
        draw = self._drawer(n)
        tokens = [draw(mx.take_along_axis(logits, at, axis=1), 0)]
        self.draft_cache.keep(width, [lag + 1 for lag in lags])
        for s in self.sequences:
            s.lag = 0
        for j in range(1, n):
            logits = self.draft_cache(tokens[-1][:, None], undoable=True)
            tokens.append(draw(logits[:, -1:], j))
        return mx.stack(tokens, axis=1).astype(mx.uint32)

    def _inputs(self, drafts: mx.array) -> mx.array:
        """``[B, 1 + N]`` uint32: each row's last token, then its drafts, an id the target lacks
        (a draft model's padded vocabulary) or an unused column given as a valid id instead:
        nothing after a rejected or unused position is kept."""
        last = mx.array([[s.text.ids(len(s.text) - 1)[0]] for s in self.sequences], mx.uint32)
        fed = mx.where(drafts >= self.vocab, last, drafts) if self.vocab else drafts
        return mx.concatenate([last, fed], axis=1)

    def _processed(
        self, logits: mx.array, fed: mx.array | None = None, drafts: mx.array | None = None
    ) -> mx.array:
        """``[B, W, V]`` target ``logits`` after each row's logits processors: position ``j``
        of row ``i`` given its text, then (a plain step ahead of the text) its ``fed`` token, or
        (a round) its first ``j`` ``drafts``. A row's positions past its own drafts, which
        decide nothing, are left as they are."""
        if not any(s.processors for s in self.sequences):
            return logits
        rows = []
        for i, s in enumerate(self.sequences):
            if not s.processors:
                rows.append(logits[i])
                continue
            context = s.text.array()
            if fed is not None:
                context = mx.concatenate([context, fed[i : i + 1]])
            own = min(drafts.shape[1], s.cap) + 1 if drafts is not None else 1
            positions = []
            for j in range(logits.shape[1]):
                row = logits[i, j : j + 1]
                if j < own:
                    tokens = mx.concatenate([context, drafts[i, :j]]) if j else context
                    for processor in s.processors:
                        row = processor(tokens, row)
                positions.append(row)
            rows.append(mx.concatenate(positions))
        return mx.stack(rows)

    def _decide(self, logits: mx.array, drafts: mx.array) -> mx.array:
        """The round's lazy ``[B, 3]`` decisions, each row under its own rule."""
        rules = [s.rule for s in self.sequences]
        if not any(rule.random for rule in rules):
            return decide(logits, drafts, self._eos)
        states = [s.states(drafts.shape[1], draft=False) for s in self.sequences]
        return decide_drawn(*choices(logits, rules, states), drafts, self._eos)

    def next(self) -> list[Response]:
        """Runs one round, or one plain step where the round drafts nothing.

        Plain steps run as mlx-lm's ``GenerationBatch`` runs them: each is started before the
        one before it is read. After each the draft lengths are chosen again; once a round
        drafts, the step already started is read first.

        Returns:
            list: a ``GenerationBatch.Response`` for each token emitted, in order per sequence;
            a sequence's last one has its finish reason (``"stop"`` or ``"length"``), its
            prompt cache (with ``return_prompt_caches``: the target's layers, then the draft
            model's, holding its prompt and every token it emitted) and all its tokens.
            Finished sequences leave the batch.
        """
        if not self.sequences:
            return []
        self.rounds += 1
        if self._ahead is None:
            n = self._plan()
            if n:
                return self._round(n)
            self._clock = time.perf_counter()
            self._ahead = self._start_step(self._last(), 0)
            self._first, self._more = True, True
        return self._step()

    @property
    def in_flight(self) -> bool:
        """bool: whether a plain step has been started and not read."""
        return self._ahead is not None

    def settle(self) -> None:
        """Ends a stretch of plain steps after the step already started, so that the next
        :meth:`next` leaves no step in flight (before :meth:`extend`)."""
        self._more = False

    def extend(self, other: SpeculativeBatch) -> None:
        """Adds the sequences of ``other`` (made on the same models, nothing run yet) to this
        batch, at its end.

        Raises:
            ValueError: a plain step of this batch is in flight (:meth:`settle` first).
        """
        if self._ahead is not None:
            raise ValueError("SpeculativeBatch.extend: a plain step is in flight; settle first")
        self.sequences += other.sequences
        self._seeds = self._seeds or other._seeds
        self.cache.extend(other.cache)
        if self.draft_cache is not None:
            self.draft_cache.extend(other.draft_cache)
        if self.head is not None:
            self.head.extend(other.head)

    def remove(self, uids: Sequence[int], return_prompt_caches: bool = False) -> dict[int, Any]:
        """Takes sequences ``uids`` out of the batch.

        Args:
            uids (list of int): ids of sequences in the batch (others are ignored).
            return_prompt_caches (bool): give each one's caches. Default: ``False``.

        Returns:
            dict: uid to ``(caches, tokens)``: the caches of that sequence alone (the
            target's, then the draft model's), holding its prompt and every token it emitted,
            and those tokens (ints); empty without ``return_prompt_caches``.
        """
        gone = set(uids)
        caches = {}
        if return_prompt_caches:
            for s in self.sequences:
                if s.uid in gone:
                    caches[s.uid] = (self._final_cache(s.uid), s.text.ids(0))
        self._filter([i for i, s in enumerate(self.sequences) if s.uid not in gone])
        return caches

    def _last(self) -> mx.array:
        """``[B]`` uint32: each row's last token."""
        return mx.array([s.text.ids(len(s.text) - 1)[0] for s in self.sequences], mx.uint32)

    def _start_step(
        self, fed: mx.array, ahead: int
    ) -> tuple[mx.array, mx.array, mx.array, mx.array | None]:
        """A plain step feeding ``[B]`` ``fed``, ``ahead`` tokens past each row's text, started:
        the lazy ``[B]`` uint32 tokens (:data:`mlx_spec.INVALID_ROW` where a row cannot decide),
        the ``[B]`` ids to feed next, the ``[B, V]`` log-probabilities and, with an MTP head,
        the ``[B, 1, H]`` hidden states of the positions fed."""
        saved = mx.random.state[0] if self._seeds else None
        logits = self._processed(self.cache(fed[:, None]), fed if ahead else None)
        logits = logits[:, 0]
        hidden = self.cache.hidden
        rules = [s.rule for s in self.sequences]
        if len(set(rules)) == 1:
            # One rule's graph for the whole batch, as a single sequence's plain step draws.
            keys = self._step_keys(ahead) if rules[0].random else None
            on_cpu = device_type(None) == mx.cpu
            tokens, fed, logprobs = rules[0].step(logits, keys, on_cpu=on_cpu)
        else:
            states = [s.states(0, draft=False, ahead=ahead) for s in self.sequences]
            chosen, invalid = choices(logits[:, None], rules, states)
            tokens = mx.where(invalid[:, 0], INVALID_ROW, chosen[:, 0]).astype(mx.uint32)
            fed = mx.minimum(tokens, logits.shape[-1] - 1)
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        mx.async_eval(tokens)
        if saved is not None:
            set_global_state(saved)
        return tokens, fed, logprobs, hidden

    def _step_keys(self, ahead: int) -> mx.array:
        """``[B, 2]`` uint32: each row's key for a plain step ``ahead`` tokens past its text,
        every row under one random rule. A column of a table of each row's keys for the next
        :data:`mlx_spec.keys.BLOCK` positions, made once for the batch's rows as they stand: the
        steps of a stretch advance every row by one, so each takes one slice, not one per row
        and a concatenation."""
        uids = [s.uid for s in self.sequences]
        at = [s.text.position + ahead for s in self.sequences]
        if self._keys is not None:
            made_for, made_at, table = self._keys
            t = at[0] - made_at[0]
            if (
                made_for == uids
                and 0 <= t < BLOCK
                and all(a - b == t for a, b in zip(at, made_at, strict=True))
            ):
                return table[:, t]
        rows = zip(self.sequences, at, strict=True)
        self._keys = uids, at, mx.stack([s.rule.position_keys(s.keys, a, BLOCK) for s, a in rows])
        return self._keys[2][:, 0]

    def _step(self) -> list[Response]:
        """Reads the plain step started, having started the next one unless drafting resumes."""
        tokens, fed, logprobs, hidden = self._ahead
        self._ahead = self._start_step(fed, 1) if self._more else None
        # The step's one read, of its tokens alone: an op on them would queue behind the step
        # ahead, and the read would wait for both.
        read = tokens.tolist()
        now = time.perf_counter()
        seconds, self._clock = now - self._clock, now
        responses = []
        guessed = 0
        for i, (s, token) in enumerate(zip(self.sequences, read, strict=True)):
            check_next("mlx_spec.batch_generate", token, (i,))
            guessed += bool(s.draft)
            if s.estimate is not None:
                # The guess of the plan before this step, tested without verifying it.
                right = int(bool(s.draft) and s.draft[0] == token)
                s.estimate.observe(Outcome(int(bool(s.draft)), right, s.label, plain=True))
            responses.extend(self._emit(s, [token], logprobs, i))
            if s.drafter is not None:
                s.drafter.update(s.text, 0)
            if hidden is not None:
                s.hidden.append(hidden[i])
            s.lag += 1
        if self.policy is not None:
            outcome = Outcome(guessed, 0, seconds=seconds, plain=True, first=self._first)
            self.policy.observe(len(self.sequences), outcome)
        self._first = False
        self._leave(responses)
        if self._ahead is not None and self.sequences:
            self._more = self._plan() == 0
        return responses

    def _round(self, n: int) -> list[Response]:
        """One round drafting up to ``n`` tokens a row, with one host read."""
        start = time.perf_counter()
        saved = mx.random.state[0] if self._seeds else None
        drafts = self._proposals(n)
        logits = self._processed(self.cache(self._inputs(drafts), undoable=True), drafts=drafts)
        hidden = self.cache.hidden
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        decided = self._decide(logits, drafts)
        read = np.array(mx.concatenate([decided, drafts], axis=1))
        if saved is not None:
            set_global_state(saved)
        kept = []
        responses = []
        for i, s in enumerate(self.sequences):
            accepted, token, _ = (int(x) for x in read[i, :3])
            check_next("mlx_spec.batch_generate", token, (i,))
            emitted = [int(x) for x in read[i, 3 : 3 + accepted]] + [token]
            own = self._emit(s, emitted, logprobs, i)
            # The caches keep the positions of the tokens its text took (all of them, unless it
            # ended inside the round): its last token and the drafts before the next one.
            kept.append(len(own))
            responses.extend(own)
            if hidden is not None:
                s.hidden.append(hidden[i, : len(own)])
            if s.drafter is not None:
                s.drafter.update(s.text, accepted)
            if self.draft_model is not None:
                s.lag += accepted + 1 - min(accepted + 1, n)
            if s.estimate is not None:
                s.estimate.observe(Outcome(min(n, s.cap), accepted, s.label))
        self.cache.keep(n + 1, kept)
        if self.draft_cache is not None:
            self.draft_cache.keep(n, [min(k, n) for k in kept])
        if self.policy is not None:
            seconds = time.perf_counter() - start
            self.policy.observe(len(self.sequences), Outcome(n, 0, seconds=seconds))
        self._leave(responses)
        return responses

    def _leave(self, responses: list[Response]) -> None:
        """Finished sequences leave the batch, their caches in their last response if asked."""
        done = {r.uid for r in responses if r.finish_reason is not None}
        for r in responses:
            if r.finish_reason is not None and self.return_prompt_caches:
                r.prompt_cache = self._final_cache(r.uid)
        self._filter([i for i, s in enumerate(self.sequences) if s.uid not in done])

    def _emit(
        self, s: _Sequence, emitted: list[int], logprobs: mx.array, row: int
    ) -> list[Response]:
        """Appends ``emitted`` to ``s``'s text up to where it finishes, as responses, each with
        its log-probabilities: of batch row ``row`` of ``logprobs``, ``[B, V]`` for one token
        (a plain step) or ``[B, len(emitted) or more, V]`` (a round), taken with one index."""
        responses = []
        for j, token in enumerate(emitted):
            own = logprobs[row] if logprobs.ndim == 2 else logprobs[row, j]
            s.text.extend([token])
            # mlx-lm's order: a stop sequence's last token ends a sequence as "stop" also when
            # it is the last token it may emit.
            reason = "length" if s.text.position >= s.max_tokens else None
            reason = "stop" if s.ends(token, self.eos) else reason
            everything = s.text.ids(0) if reason else None
            responses.append(Response(s.uid, token, own, reason, None, everything))
            if reason:
                break
        return responses

    def _final_cache(self, uid: int) -> list[Any]:
        """The caches of sequence ``uid`` alone (the target's, then the draft model's), holding
        its prompt and every token it emitted: the tokens a round leaves unfed (the caches never
        hold more than the text) are fed here."""
        i = next(i for i, s in enumerate(self.sequences) if s.uid == uid)
        s = self.sequences[i]
        final = []
        for batched in (self.cache, self.draft_cache):
            if batched is None:
                continue
            caches = batched.extract(i)
            missing = len(s.text) - held(caches)
            if missing > 0:
                batched.model(mx.array([s.text.ids(len(s.text) - missing)]), cache=caches)
            final += caches
        return final

    def _filter(self, keep: list[int]) -> None:
        """Keeps rows ``keep`` of the batch and its caches."""
        if len(keep) == len(self.sequences):
            return
        self.sequences = [self.sequences[i] for i in keep]
        if not keep:
            self._more = False
        if self._ahead is not None:
            rows = mx.array(keep, dtype=mx.int32)
            parts = (None if part is None else part[rows] for part in self._ahead)
            self._ahead = tuple(parts) if keep else None
        for caches in (self.cache, self.draft_cache, self.head):
            if caches is not None:
                caches.filter(keep)


def _sequence(
    uid: int,
    prompt: list[int],
    drafter: Drafter | None,
    draft_length: int,
    max_tokens: int,
    rule: Rule,
    key: mx.array | None,
    policy: BatchAdaptive | None,
    stop: Any = None,
    processors: list[Any] | None = None,
) -> _Sequence:
    """A sequence with its own copy of ``drafter``, started on its prompt, the chain of its key
    where its rule samples, its acceptance estimate where ``policy`` adapts and its matcher of
    the ``stop`` sequences where given."""
    text = Text(mx.array(prompt, dtype=mx.uint32), list(prompt))
    mine = None
    if drafter is not None:
        mine = copy.deepcopy(drafter)
        mine.start(text, DraftSetup(rule))
    chain = KeyChain(key, rule.steps) if rule.random else None
    estimate = policy.sequence() if policy is not None else None
    matcher = stop.matcher() if stop is not None else None
    return _Sequence(
        uid,
        text,
        mine,
        draft_length,
        max_tokens,
        rule,
        chain,
        estimate,
        stop=matcher,
        processors=list(processors or []),
    )


def _per_prompt(
    op: str, name: str, value: object, count: int, least: int, most: int | None
) -> list[int]:
    """An int for every prompt, from one int or a list of ``count``."""
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise ValueError(
                f"{op}: `{name}` must be an int or a list of one per prompt ({count}), got a "
                f"list of {len(value)}"
            )
        return [check_int(op, name, v, least, most) for v in value]
    return [check_int(op, name, value, least, most)] * count


def _per_sequence(op: str, name: str, value: object, count: int) -> list[Any]:
    """A list of ``count`` items (``None`` where ``value`` is ``None``)."""
    if value is None:
        return [None] * count
    if not isinstance(value, (list, tuple)) or len(value) != count:
        raise ValueError(
            f"{op}: `{name}` must be None or a list of one per prompt ({count}), got {value!r}"
        )
    return list(value)


def _check_prompts(op: str, prompts: object, vocab: int | None) -> list[list[int]]:
    """The prompts as lists of ids, each non-empty and inside the target's vocabulary."""
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError(
            f"{op}: `prompts` must be a non-empty list of token id lists, got {prompts!r}"
        )
    limit = vocab if vocab is not None else 2**32
    for i, prompt in enumerate(prompts):
        if (
            not isinstance(prompt, (list, tuple))
            or not prompt
            or not all(is_int(t) and 0 <= t < limit for t in prompt)
        ):
            raise ValueError(
                f"{op}: `prompts[{i}]` must be a non-empty list of token ids in [0, {limit}), "
                f"got {prompt!r}"
            )
    return [[int(t) for t in prompt] for prompt in prompts]


def _check_drafter(
    op: str, model: nn.Module, draft_model: object, drafter: object
) -> Drafter | None:
    """The prompt lookup drafter each sequence copies, or the :class:`mlx_spec.MTPDrafter`
    whose head drafts for the batch (``None`` with a draft model)."""
    if (draft_model is None) == (drafter is None):
        raise ValueError(
            f"{op}: give one of `draft_model` and `drafter`, got {type(draft_model).__name__} "
            f"and {drafter!r}"
        )
    if drafter is None:
        check_batchable(op, "draft_model", draft_model, draft=True)
        return None
    if isinstance(drafter, str) and drafter == "prompt-lookup":
        return PromptLookupDrafter()
    if isinstance(drafter, PromptLookupDrafter):
        return drafter
    if (isinstance(drafter, str) and drafter == "mtp") or isinstance(drafter, MTPDrafter):
        return MTPDrafter(check_head(op, model, drafter))
    raise ValueError(
        f"{op}: `drafter` must be 'prompt-lookup', 'mtp', a PromptLookupDrafter or an "
        f"MTPDrafter, got {drafter!r}"
    )


def _check_samplers(op: str, sampler: object, count: int) -> list[Any]:
    """A sampler (or ``None``, greedy) for every prompt, from one or a list of ``count``."""
    listed = isinstance(sampler, (list, tuple))
    samplers = list(sampler) if listed else [sampler] * count
    if len(samplers) != count:
        raise ValueError(
            f"{op}: `sampler` must be a sampler or a list of one per prompt ({count}), got a "
            f"list of {len(samplers)}"
        )
    for i, one in enumerate(samplers):
        check_callable(op, f"sampler[{i}]" if listed else "sampler", one)
    return samplers


def _check_keys(op: str, keys: object, rules: list[Rule]) -> list[mx.array | None]:
    """Each sequence's key: the given ones, or for every sequence that samples a key drawn from
    ``mx.random``'s global state (one draw for the batch, as ``mx.random.seed`` reproduces)."""
    if keys is None:
        if not any(rule.random for rule in rules):
            return [None] * len(rules)
        # The key a draw would take, as mx.random's key sequence hands it out, split in one a row.
        following, key = mx.random.split(mx.random.state[0])
        set_global_state(following)
        drawn = mx.random.split(key, len(rules))
        return [drawn[i] if rule.random else None for i, rule in enumerate(rules)]
    if not isinstance(keys, (list, tuple)) or len(keys) != len(rules):
        raise ValueError(
            f"{op}: `keys` must be None or a list of one key per prompt ({len(rules)}), got "
            f"{keys!r}"
        )
    checked = []
    for i, (key, rule) in enumerate(zip(keys, rules, strict=True)):
        if key is None and rule.random:
            raise ValueError(f"{op}: `keys[{i}]` is None, but sequence {i} samples")
        checked.append(None if key is None else check_key(f"{op}: `keys[{i}]`", key))
    return checked


def batch_generate(
    model: nn.Module,
    tokenizer: Any,
    prompts: Sequence[Sequence[int]],
    *,
    draft_model: nn.Module | None = None,
    drafter: str | Drafter | None = None,
    num_draft_tokens: int | Sequence[int] = 3,
    adaptive: bool = True,
    policy: BatchAdaptive | None = None,
    max_tokens: int | Sequence[int] = 128,
    sampler: Any = None,
    keys: Sequence[mx.array | None] | None = None,
    acceptance: str = "coupled",
    prefill_step_size: int = 2048,
    verbose: bool = False,
    return_prompt_caches: bool = False,
    return_token_ids: bool = False,
    return_logprobs: bool = False,
    logits_processors: Sequence[Any] | None = None,
    completion_batch_size: int | None = None,
) -> BatchResponse:
    """Speculative decoding of many prompts at once: a drop-in for ``mlx_lm.batch_generate``.

    The prompts are decoded together (:class:`SpeculativeBatch`), each round one target call
    over every sequence's last token and drafts. Each sequence has its own sampler and key. A
    greedy one's tokens are the target's greedy decoding, those mlx-lm's ``batch_generate``
    gives the same prompts. One that samples takes the coupled rule (:mod:`mlx_spec.rules`): its
    text is what :func:`mlx_spec.generate` gives its prompt alone with the same sampler and key,
    whatever the batch, the drafter and the draft lengths.

    Args:
        model (nn.Module): the target model: its caches must be ``KVCache`` layers, sliding
            windows (the Gemma 3 family), or the gated delta-net layers of hybrids (Qwen3-Next,
            Qwen3.5 / 3.6) beside them (:func:`mlx_spec.batch_caches.check_batchable`).
        tokenizer (TokenizerWrapper): the target's tokenizer: its ``eos_token_ids`` end a
            sequence, and it decodes the texts.
        prompts (list of list of int): ``B >= 1`` prompts, each ``[L_i]`` token ids, ``L_i >= 1``,
            inside the target's vocabulary.
        draft_model (nn.Module, optional): a draft model with the target's tokenizer and
            caches that batch as the target's do (no sliding windows), run as a batch. Give it
            or ``drafter``.
        drafter (str or Drafter, optional): ``"prompt-lookup"``, or a
            :class:`mlx_spec.PromptLookupDrafter` whose settings each sequence copies into its
            own index; or ``"mtp"`` (or an :class:`mlx_spec.MTPDrafter`): the target's MTP head
            (:mod:`mlx_spec.batch_mtp`; one layer), which needs no draft model.
        num_draft_tokens (int or list of int): the most draft tokens a round, in
            ``[0, MAX_DRAFT_TOKENS]``, for all prompts or one per prompt (``0``: that sequence
            does not draft). Default: ``3``.
        adaptive (bool): choose each round's draft lengths, up to ``num_draft_tokens``, from
            each sequence's acceptance and the measured cost of a round at the batch's size,
            drafting nothing where it does not pay (:class:`mlx_spec.batch_length.BatchAdaptive`);
            ``False`` drafts ``num_draft_tokens`` every round. Default: ``True``.
        policy (BatchAdaptive, optional): the adaptive policy to use, to keep what it measured
            from one call to the next, or to give it calibrations. Default: a new one.
        max_tokens (int or list of int): tokens to generate, ``>= 1``, for all prompts or one
            per prompt. Default: ``128``.
        sampler (callable or list, optional): a sampler for every prompt, or a list of one per
            prompt (``None``: greedy), mapping ``[..., V]`` log-probabilities to tokens, as
            ``mlx_lm.sample_utils.make_sampler`` or :func:`mlx_spec.make_sampler` makes them.
            Default: greedy.
        keys (list of array, optional): one ``[2]`` uint32 key per prompt (``mx.random.key``),
            the random state before the sequence's first generated token (``None`` for a greedy
            one). Default: one drawn for each sampled sequence from ``mx.random``'s global
            state, so ``mx.random.seed`` reproduces the batch.
        acceptance (str): ``"coupled"``, the only rule batches take for now. Default:
            ``"coupled"``.
        prefill_step_size (int): prompt tokens per prefill call, ``>= 1``. Default: ``2048``.
        verbose (bool): print the statistics at the end. Default: ``False``.
        return_prompt_caches (bool): return each sequence's target caches, holding its prompt
            and every token it generated. Default: ``False``.
        return_token_ids (bool): return the generated ids. Default: ``False``.
        return_logprobs (bool): return each generated token's float log-probability.
            Default: ``False``.
        logits_processors (list, optional): logits processors (``processor(tokens, logits)``,
            as ``mlx_lm.sample_utils.make_logits_processors`` makes them) applied to every
            sequence's target logits at every position, as mlx-lm's ``BatchGenerator`` applies
            its ``logits_processors``. Default: none.
        completion_batch_size (int, optional): the most sequences decoded at once, ``>= 1``:
            with more prompts, the others join as sequences finish
            (:class:`SpeculativeBatchGenerator`, their prefill then counted in the decoding
            time), as mlx-lm's ``BatchGenerator`` decodes them in turns. Default: all at once.

    Returns:
        BatchResponse: mlx-lm's, in the order of ``prompts``: ``texts``, ``stats`` (rounds
        counted as ``generation_steps``), and ``caches``, ``token_ids`` and ``logprobs`` where
        asked for. A sequence's EOS token ends it and is not part of its text, as in mlx-lm.

    Raises:
        ValueError: an argument is of the wrong type or out of range, a model's caches do not
            batch, ``acceptance`` is not ``"coupled"``, or ``policy`` is given with
            ``adaptive=False``; the message names the argument.
            Raised before any work.
    """
    op = "mlx_spec.batch_generate"
    check_batchable(op, "model", model)
    copied = _check_drafter(op, model, draft_model, drafter)
    ids = _check_prompts(op, prompts, vocab_size(model))
    lengths = _per_prompt(op, "num_draft_tokens", num_draft_tokens, len(ids), 0, MAX_DRAFT_TOKENS)
    most = _per_prompt(op, "max_tokens", max_tokens, len(ids), 1, None)
    samplers = _check_samplers(op, sampler, len(ids))
    if acceptance != "coupled":
        raise ValueError(
            f"{op}: `acceptance` must be 'coupled' (the residual rule does not batch yet), got "
            f"{acceptance!r}"
        )
    rules = [make_rule(s, acceptance, vocab_size(model)) for s in samplers]
    check_int(op, "prefill_step_size", prefill_step_size, 1)
    for name, flag in (
        ("adaptive", adaptive),
        ("verbose", verbose),
        ("return_prompt_caches", return_prompt_caches),
        ("return_token_ids", return_token_ids),
        ("return_logprobs", return_logprobs),
    ):
        if not isinstance(flag, bool):
            raise ValueError(f"{op}: `{name}` must be a bool, got {flag!r}")
    if policy is not None and not isinstance(policy, BatchAdaptive):
        raise ValueError(f"{op}: `policy` must be a BatchAdaptive, got {policy!r}")
    if policy is not None and not adaptive:
        raise ValueError(f"{op}: `policy` is given with `adaptive=False`; give one or the other")
    if adaptive and policy is None and max(lengths):
        policy = BatchAdaptive(max(lengths))
    processors = list(logits_processors or [])
    if not all(callable(f) for f in processors):
        raise ValueError(
            f"{op}: `logits_processors` must be a list of callables, got {logits_processors!r}"
        )
    if completion_batch_size is not None:
        check_int(op, "completion_batch_size", completion_batch_size, 1)
    chosen = _check_keys(op, keys, rules)
    stats = BatchStats()
    start = time.perf_counter()
    eos = list(tokenizer.eos_token_ids)
    with mx.stream(_mlx_lm.lm.generation_stream):
        batch: SpeculativeBatch | SpeculativeBatchGenerator
        if completion_batch_size is None or completion_batch_size >= len(ids):
            batch = SpeculativeBatch(
                model, ids, lengths, most, eos, samplers, chosen,
                draft_model=draft_model, drafter=copied, prefill_step_size=prefill_step_size,
                return_prompt_caches=return_prompt_caches, policy=policy if adaptive else None,
                logits_processors=[processors] * len(ids),
            )  # fmt: skip
        else:
            batch = SpeculativeBatchGenerator(
                model, draft_model=draft_model, drafter=copied, num_draft_tokens=max(lengths),
                adaptive=adaptive, policy=policy if adaptive else None, eos_token_ids=eos,
                completion_batch_size=completion_batch_size, prefill_step_size=prefill_step_size,
                return_prompt_caches=return_prompt_caches,
            )  # fmt: skip
            batch.insert(
                ids, most, samplers, chosen,
                draft_lengths=lengths, logits_processors=[processors] * len(ids),
            )  # fmt: skip
        stats.prompt_tokens = sum(len(p) for p in ids)
        stats.prompt_time = time.perf_counter() - start
        results = _run(batch, stats)
    stats.wall_time = time.perf_counter() - start
    stats.peak_memory = mx.get_peak_memory() / 1e9
    if verbose:
        print(
            f"[batch_generate] Prompt: {stats.prompt_tokens} tokens, {stats.prompt_tps:.3f} "
            f"tokens-per-sec\n[batch_generate] Generation: {stats.generation_tokens} tokens in "
            f"{stats.generation_steps} rounds, {stats.generation_tps:.3f} tokens-per-sec"
        )
    tokens = [[r.token for r in rs if r.finish_reason != "stop"] for rs in results]
    layers = len(make_prompt_cache(model))
    return BatchResponse(
        texts=[tokenizer.decode(t) for t in tokens],
        stats=stats,
        # The target's layers alone, as mlx-lm's (a draft model's follow them).
        caches=[rs[-1].prompt_cache[:layers] for rs in results] if return_prompt_caches else None,
        token_ids=tokens if return_token_ids else None,
        logprobs=[
            [r.logprobs[r.token].item() for r in rs if r.finish_reason != "stop"] for rs in results
        ]
        if return_logprobs
        else None,
    )


def _run(
    batch: SpeculativeBatch | SpeculativeBatchGenerator, stats: BatchStats
) -> list[list[Response]]:
    """Runs ``batch`` to its end: each sequence's responses, by uid."""
    results: list[list[Response]] = [[] for _ in range(len(batch))]
    while len(batch):
        tic = time.perf_counter()
        responses = batch.next()
        stats.decode_time += time.perf_counter() - tic
        stats.generation_steps += 1
        stats.generation_tokens += len(responses)
        for r in responses:
            results[r.uid].append(r)
    return results


PromptResponse = PromptProcessingBatch.Response


@dataclass
class _Joining:
    """A sequence being prefilled before it joins the batch.

    Attributes:
        entry (tuple): its waiting entry (see ``SpeculativeBatchGenerator._waiting``).
        done (int): the prompt tokens its caches hold.
        ends (list of int): the ends of its prompt's segments still ahead, ascending, each
            below the prompt's length.
        start (int): the prompt tokens its caches held when it came.
        hidden (list of array): with an MTP head, the ``[k, H]`` hidden states of each chunk
            prefilled since.
    """

    entry: tuple[Any, ...]
    done: int
    ends: list[int]
    start: int = 0
    hidden: list[mx.array] = field(default_factory=list)

    @property
    def prompt(self) -> list[int]:
        return self.entry[1]

    def chunk(self, step: int) -> list[int]:
        """Its next prompt tokens to prefill: up to ``step``, never past a segment's end nor
        into the prompt's last token (the first round feeds it)."""
        return self.prompt[self.done : min(self.done + step, len(self.prompt) - 1, *self.ends[:1])]

    def response(self, *, joins: bool = False) -> PromptResponse:
        """Its progress, as mlx-lm's ``PromptProcessingBatch.Response``: after a chunk (the
        end of a segment where the chunk reached one, or all of the prompt but its last
        token), or as it ``joins`` the batch (its whole prompt)."""
        total = len(self.prompt)
        if joins:
            return PromptResponse(self.entry[0], (total, total), True, True)
        end = self.done == total - 1 or (bool(self.ends) and self.done == self.ends[0])
        return PromptResponse(self.entry[0], (self.done, total), end, False)


class _Prefill:
    """Sequences prefilled a chunk at a time, as mlx-lm's ``BatchGenerator`` prefills them
    between generation steps: one ``PromptProcessingBatch`` for the target and one for the
    draft model, row ``i`` of each holding :attr:`rows` ``[i]``'s prompt so far."""

    def __init__(
        self, models: list[nn.Module], step: int, capture: Capturing | None = None
    ) -> None:
        self.models = models
        self.step = step
        self.capture = capture
        self.rows: list[_Joining] = []
        self.batches: list[PromptProcessingBatch] = []
        #: The prompt tokens prefilled so far.
        self.tokens = 0

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, entries: list[tuple[Any, ...]]) -> list[tuple[_Joining, list[Any]]]:
        """Starts prefilling ``entries`` (waiting entries), each from its own caches where it
        has some; those whose caches hold all of the prompt but its last token are given back
        at once, with their caches."""
        layers = [len(make_prompt_cache(m)) for m in self.models]
        rows, caches, prefilled = [], [[] for _ in self.models], []
        for entry in entries:
            started = entry[6]
            count = held(started) if started is not None else 0
            row = _Joining(entry, count, [e for e in entry[8] if e > count], count)
            own = started or [c for model in self.models for c in make_prompt_cache(model)]
            if count == len(row.prompt) - 1:
                prefilled.append((row, own))
                continue
            rows.append(row)
            for k in range(len(self.models)):
                first = sum(layers[:k])
                caches[k].append(own[first : first + layers[k]])
        if not rows:
            return prefilled
        uids = [row.entry[0] for row in rows]
        # mlx-lm's filter takes every per-row list, samplers and processors included (unused).
        made = [
            PromptProcessingBatch(
                self.capture if k == 0 and self.capture is not None else m,
                list(uids),
                c,
                prefill_step_size=self.step,
                samplers=[None] * len(uids),
                logits_processors=[[] for _ in uids],
            )
            for k, (m, c) in enumerate(zip(self.models, caches, strict=True))
        ]
        if self.batches:
            for batch, more in zip(self.batches, made, strict=True):
                batch.extend(more)
        else:
            self.batches = made
        self.rows += rows
        return prefilled

    def chunk(self) -> list[PromptResponse]:
        """Prefills each row's next chunk (:meth:`_Joining.chunk`): its progress, and the end
        of a segment where one is reached."""
        chunks = [row.chunk(self.step) for row in self.rows]
        if not self.rows or not any(chunks):
            return []
        for batch in self.batches:
            batch.prompt(chunks)
        self.tokens += sum(map(len, chunks))
        states = self.capture.rows([len(c) for c in chunks]) if self.capture is not None else []
        for row, rows in zip(self.rows, states, strict=False):
            if rows.size:
                row.hidden.append(rows)
        responses = []
        for row, chunk in zip(self.rows, chunks, strict=True):
            row.done += len(chunk)
            responses.append(row.response())
            if row.ends and row.done == row.ends[0]:
                row.ends.pop(0)
        return responses

    def caches(self, i: int) -> list[Any]:
        """Row ``i``'s caches alone: the target's layers, then the draft model's."""
        return [layer for batch in self.batches for layer in batch.extract_cache(i)]

    def take(self, rows: list[int]) -> list[tuple[_Joining, list[Any]]]:
        """Takes ``rows`` out, each with its caches alone."""
        taken = [(self.rows[i], self.caches(i)) for i in rows]
        keep = [i for i in range(len(self.rows)) if i not in set(rows)]
        self.rows = [self.rows[i] for i in keep]
        for batch in self.batches:
            batch.filter(keep)
        if not self.rows:
            self.batches = []
        return taken

    def ready(self) -> list[int]:
        """The rows whose caches hold all of their prompt but its last token: after the call
        that reported it, as in mlx-lm, so that the server may file the caches of that last
        segment's end (:meth:`SpeculativeBatchGenerator.extract_cache`)."""
        return [i for i, row in enumerate(self.rows) if row.done == len(row.prompt) - 1]

    @property
    def nbytes(self) -> int:
        """int: the bytes of the caches it holds."""
        return sum(c.nbytes for batch in self.batches for c in batch.prompt_cache)


class SpeculativeBatchGenerator:
    """Continuous batching with speculation: the counterpart of mlx-lm's ``BatchGenerator``,
    whose sequences join (:meth:`insert`) and leave (:meth:`remove`, or at their end) while
    others run.

    Each :meth:`next` first admits waiting sequences to the prefill, as many as
    ``completion_batch_size`` and ``prefill_batch_size`` leave room for, and prefills one chunk
    of ``prefill_step_size`` tokens of each (never past the end of a segment its
    :meth:`insert` names), so that a long prompt joining stalls the running sequences for one
    chunk at a time, as in mlx-lm. Sequences whose prompts are prefilled (but their last
    token, which their first round feeds) join the running :class:`SpeculativeBatch` (once
    the plain step in flight, if any, is read). It then runs one round, or one plain step, of
    the whole batch.

    Args:
        model (nn.Module): the target model; its caches must batch
            (:func:`mlx_spec.batch_caches.check_batchable`).
        draft_model (nn.Module, optional): a draft model, run as a batch. Give it or ``drafter``.
        drafter (str or Drafter, optional): ``"prompt-lookup"``, or a
            :class:`mlx_spec.PromptLookupDrafter` each sequence copies; or ``"mtp"``, the
            target's MTP head (:func:`batch_generate`).
        num_draft_tokens (int): the most draft tokens a round, in ``[0, MAX_DRAFT_TOKENS]``.
            Default: ``3``.
        adaptive (bool): adapt the draft lengths to the load (:class:`BatchAdaptive`, one for
            every sequence the generator runs). Default: ``True``.
        policy (BatchAdaptive, optional): that policy, to keep or give what it measured.
            Default: a new one.
        max_tokens (int): tokens a sequence generates unless :meth:`insert` says. Default:
            ``128``.
        eos_token_ids (list of int): ids that end a sequence. Default: none.
        sampler (callable, optional): the sampler of sequences :meth:`insert` gives none.
            Default: greedy.
        completion_batch_size (int): the most sequences decoded at once, ``>= 1``. Default:
            ``32``.
        prefill_batch_size (int, optional): the most sequences prefilled together when they
            join, ``>= 1``. Default: as many as there is room for.
        prefill_step_size (int): prompt tokens per prefill call, ``>= 1``. Default: ``2048``.
        return_prompt_caches (bool): give each finished sequence's caches in its last response
            (:class:`SpeculativeBatch`). Default: ``False``.
        stream (mx.Stream, optional): the stream everything runs on. Default: mlx-lm's
            generation stream.

    Raises:
        ValueError: an argument is of the wrong type or out of range; the message names it.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        draft_model: nn.Module | None = None,
        drafter: str | Drafter | None = None,
        num_draft_tokens: int = 3,
        adaptive: bool = True,
        policy: BatchAdaptive | None = None,
        max_tokens: int = 128,
        eos_token_ids: Sequence[int] = (),
        sampler: Any = None,
        completion_batch_size: int = 32,
        prefill_batch_size: int | None = None,
        prefill_step_size: int = 2048,
        return_prompt_caches: bool = False,
        stream: mx.Stream | None = None,
    ) -> None:
        op = "SpeculativeBatchGenerator"
        check_batchable(op, "model", model)
        self._drafter = _check_drafter(op, model, draft_model, drafter)
        self.num_draft_tokens = check_int(
            op, "num_draft_tokens", num_draft_tokens, 0, MAX_DRAFT_TOKENS
        )
        if not isinstance(adaptive, bool):
            raise ValueError(f"{op}: `adaptive` must be a bool, got {adaptive!r}")
        if policy is not None and (not isinstance(policy, BatchAdaptive) or not adaptive):
            raise ValueError(
                f"{op}: `policy` must be a BatchAdaptive with adaptive=True, got {policy!r}"
            )
        if adaptive and policy is None and num_draft_tokens:
            policy = BatchAdaptive(num_draft_tokens)
        self.policy = policy if adaptive else None
        self.max_tokens = check_int(op, "max_tokens", max_tokens, 1)
        self.sampler = _check_samplers(op, sampler, 1)[0]
        self.completion_batch_size = check_int(
            op, "completion_batch_size", completion_batch_size, 1
        )
        self.prefill_batch_size = (
            None
            if prefill_batch_size is None
            else check_int(op, "prefill_batch_size", prefill_batch_size, 1)
        )
        self.prefill_step_size = check_int(op, "prefill_step_size", prefill_step_size, 1)
        if not isinstance(return_prompt_caches, bool):
            raise ValueError(
                f"{op}: `return_prompt_caches` must be a bool, got {return_prompt_caches!r}"
            )
        if stream is not None and not isinstance(stream, (mx.Stream, mx.Device)):
            raise ValueError(f"{op}: `stream` must be an mx.Stream or None, got {stream!r}")
        self.return_prompt_caches = return_prompt_caches
        self.stream = stream if stream is not None else _mlx_lm.lm.generation_stream
        self.model = model
        self.draft_model = draft_model
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        self._uids = 0
        # Sequences waiting to join: (uid, prompt, max_tokens, sampler, key, draft length,
        # caches to start from, stop sequences, segment ends, logits processors).
        self._waiting: deque[tuple[Any, ...]] = deque()
        models = [model] + ([draft_model] if draft_model is not None else [])
        mtp = isinstance(self._drafter, MTPDrafter)
        capture = Capturing(_mlx_lm.split(model)) if mtp else None
        self._prefill = _Prefill(models, self.prefill_step_size, capture)
        # Prefilled sequences waiting for the plain step in flight, with their caches.
        self._ready: list[tuple[_Joining, list[Any]]] = []
        self._batch: SpeculativeBatch | None = None
        self._counters = BatchCounters()

    def __len__(self) -> int:
        """int: the sequences running, being prefilled or waiting."""
        return len(self._waiting) + len(self._prefill) + len(self._ready) + len(self.running)

    @property
    def waiting(self) -> list[int]:
        """list of int: the uids of the sequences waiting to join, in order."""
        return [w[0] for w in self._waiting]

    @property
    def prefilling(self) -> list[int]:
        """list of int: the uids of the sequences being prefilled, or prefilled and about to
        join, in order."""
        return [row.entry[0] for row in self._prefill.rows + [r for r, _ in self._ready]]

    @property
    def running(self) -> list[int]:
        """list of int: the uids of the sequences in the batch, in order."""
        return [s.uid for s in self._batch.sequences] if self._batch is not None else []

    @property
    def prompt_cache_nbytes(self) -> int:
        """int: the bytes of every cache the generator holds, running, being prefilled or
        waiting (as mlx-lm's ``BatchGenerator.prompt_cache_nbytes`` counts them)."""
        total = sum(c.nbytes for w in self._waiting if w[6] is not None for c in w[6])
        total += self._prefill.nbytes + sum(c.nbytes for _, cs in self._ready for c in cs)
        if self._batch is not None:
            total += self._batch.cache.nbytes
            for more in (self._batch.draft_cache, self._batch.head):
                total += more.nbytes if more is not None else 0
        return total

    def insert(
        self,
        prompts: Sequence[Sequence[int]],
        max_tokens: int | Sequence[int] | None = None,
        samplers: Sequence[Any] | None = None,
        keys: Sequence[mx.array | None] | None = None,
        *,
        draft_lengths: Sequence[int] | None = None,
        prompt_caches: Sequence[list[Any] | None] | None = None,
        stop_sequences: Sequence[Any] | None = None,
        segment_ends: Sequence[Sequence[int]] | None = None,
        logits_processors: Sequence[Sequence[Any]] | None = None,
    ) -> list[int]:
        """Queues sequences to be prefilled and join the batch.

        Args:
            prompts (list of list of int): ``[L_i]`` token ids each, ``L_i >= 1``.
            max_tokens (int or list of int, optional): tokens each generates, ``>= 1``.
                Default: the generator's.
            samplers (list, optional): one sampler (or ``None``: greedy) per prompt. Default:
                the generator's.
            keys (list of array, optional): one ``[2]`` uint32 key per prompt (``None`` for a
                greedy one). Default: drawn from ``mx.random``'s global state, as
                :func:`batch_generate` draws them.
            draft_lengths (list of int, optional): each one's most draft tokens a round, in
                ``[0, MAX_DRAFT_TOKENS]``; with adaptive lengths the policy's most caps it too.
                Default: the generator's ``num_draft_tokens``.
            prompt_caches (list, optional): each one's caches to start from, or ``None``
                (:class:`SpeculativeBatch`'s ``prompt_caches``: the target's layers' caches,
                then the draft model's, holding the prompt's first tokens). Default:
                none.
            stop_sequences (list, optional): each one's mlx-lm ``StopSequences``, or ``None``
                (the generator's ``eos_token_ids`` end it). Default: none.
            segment_ends (list of list of int, optional): for each one, the prompt lengths at
                which a segment of it ends, ascending, below its length: the prefill stops at
                each (reported with ``end_of_segment``, its caches then given by
                :meth:`extract_cache`). Default: none.
            logits_processors (list, optional): each one's list of logits processors
                (:class:`SpeculativeBatch`). Default: none.

        Returns:
            list of int: each sequence's uid, numbered on from the last inserted.

        Raises:
            ValueError: an argument is of the wrong type, length or range; the message names it.
        """
        op = "SpeculativeBatchGenerator.insert"
        ids = _check_prompts(op, prompts, vocab_size(self.model))
        most = _per_prompt(op, "max_tokens", max_tokens or self.max_tokens, len(ids), 1, None)
        chosen = _check_samplers(
            op, [self.sampler] * len(ids) if samplers is None else samplers, len(ids)
        )
        rules = [make_rule(s, "coupled", vocab_size(self.model)) for s in chosen]
        lengths = _per_prompt(
            op,
            "draft_lengths",
            self.num_draft_tokens if draft_lengths is None else list(draft_lengths),
            len(ids),
            0,
            MAX_DRAFT_TOKENS,
        )
        started = _per_sequence(op, "prompt_caches", prompt_caches, len(ids))
        _split_started(op, started, ids, self.model, self.draft_model)
        stops = _per_sequence(op, "stop_sequences", stop_sequences, len(ids))
        for i, stop in enumerate(stops):
            if stop is not None and not callable(getattr(stop, "matcher", None)):
                raise ValueError(
                    f"{op}: `stop_sequences[{i}]` must be None or an mlx-lm StopSequences, got "
                    f"{stop!r}"
                )
        ends = _per_sequence(op, "segment_ends", segment_ends, len(ids))
        for i, (these, prompt) in enumerate(zip(ends, ids, strict=True)):
            listed = list(these) if isinstance(these, (list, tuple)) else None
            if these is not None and (
                listed is None
                or not all(is_int(e) and 1 <= e < len(prompt) for e in listed)
                or listed != sorted(set(listed))
            ):
                raise ValueError(
                    f"{op}: `segment_ends[{i}]` must be None or ascending ints in [1, "
                    f"{len(prompt) - 1}], got {these!r}"
                )
        processors = _per_sequence(op, "logits_processors", logits_processors, len(ids))
        for i, these in enumerate(processors):
            if these is not None and (
                not isinstance(these, (list, tuple)) or not all(callable(f) for f in these)
            ):
                raise ValueError(
                    f"{op}: `logits_processors[{i}]` must be None or a list of callables, got "
                    f"{these!r}"
                )
        drawn = _check_keys(op, keys, rules)
        uids = list(range(self._uids, self._uids + len(ids)))
        self._uids += len(ids)
        ends = [list(e) if e is not None else [] for e in ends]
        processors = [list(these or []) for these in processors]
        self._waiting.extend(
            zip(
                uids, ids, most, chosen, drawn, lengths, started, stops, ends, processors,
                strict=True,
            )
        )  # fmt: skip
        return uids

    def extract_cache(self, uids: Sequence[int]) -> dict[int, Any]:
        """The caches of sequences being prefilled, as mlx-lm's ``BatchGenerator.extract_cache``
        gives them: after a response with ``end_of_segment``, those of the segment's end.

        Args:
            uids (list of int): sequences' uids (those not being prefilled are ignored).

        Returns:
            dict: uid to ``(caches, tokens)``: its caches alone (the target's layers, then the
            draft model's), holding the ``int`` tokens ``tokens``.
        """
        wanted = set(uids)
        with mx.stream(self.stream):
            return {
                row.entry[0]: (self._prefill.caches(i), row.prompt[: row.done])
                for i, row in enumerate(self._prefill.rows)
                if row.entry[0] in wanted
            }

    def remove(self, uids: Sequence[int], return_prompt_caches: bool = False) -> dict[int, Any]:
        """Takes sequences out, waiting or running, as mlx-lm's ``BatchGenerator.remove``.

        Args:
            uids (list of int): the sequences' uids (unknown ones are ignored).
            return_prompt_caches (bool): give each one's caches. Default: ``False``.

        Returns:
            dict: uid to ``(caches, tokens)``: the target's caches of that sequence alone and
            the ``int`` tokens they hold, its prompt and every token it yielded (for a sequence
            still waiting: new empty caches and no tokens); empty without
            ``return_prompt_caches``.
        """
        gone = set(uids)
        caches: dict[int, Any] = {}
        for waiting in [w for w in self._waiting if w[0] in gone]:
            self._waiting.remove(waiting)
            if return_prompt_caches:
                caches[waiting[0]] = (make_prompt_cache(self.model), [])
        with mx.stream(self.stream):
            rows = [i for i, row in enumerate(self._prefill.rows) if row.entry[0] in gone]
            ready = [(row, cs) for row, cs in self._ready if row.entry[0] in gone]
            self._ready = [(row, cs) for row, cs in self._ready if row.entry[0] not in gone]
            for row, row_caches in self._prefill.take(rows) + ready:
                if return_prompt_caches:
                    caches[row.entry[0]] = (row_caches, row.prompt[: row.done])
            if self._batch is not None:
                caches.update(self._batch.remove(list(gone), return_prompt_caches))
        return caches

    def next(self) -> list[Response]:
        """Prefills, lets prefilled sequences join, then runs one round or plain step of the
        batch (see the class).

        Returns:
            list: a ``GenerationBatch.Response`` for each token emitted (none while nothing
            runs), as :meth:`SpeculativeBatch.next` gives them.
        """
        return self.next_with_prompts()[1]

    def next_with_prompts(self) -> tuple[list[PromptResponse], list[Response]]:
        """:meth:`next`, with the prefill's progress, as mlx-lm's ``BatchGenerator.next``.

        Returns:
            tuple: a ``PromptProcessingBatch.Response`` for each sequence prefilled this call
            (its progress; ``end_of_segment`` where the chunk reached the end of a segment;
            ``end_of_prompt`` where its prompt is prefilled), and :meth:`next`'s responses.
        """
        with mx.stream(self.stream):
            busy = len(self.running) + len(self._prefill) + len(self._ready)
            room = min(self.completion_batch_size - busy, len(self._waiting))
            if self.prefill_batch_size is not None:
                room = min(room, self.prefill_batch_size - len(self._prefill))
            # Rows prefilled by the last call join now, after the call that reported them.
            taken = self._prefill.take(self._prefill.ready())
            if room > 0:
                taken += self._prefill.add([self._waiting.popleft() for _ in range(room)])
            before, tic = self._prefill.tokens, time.perf_counter()
            prompted = self._prefill.chunk()
            self._counters.prompt_tokens += self._prefill.tokens - before
            self._counters.prompt_time += time.perf_counter() - tic
            prompted += [row.response(joins=True) for row, _ in taken]
            self._ready += taken
            if self._ready:
                if self._batch is not None and self._batch.in_flight:
                    self._batch.settle()
                else:
                    self._join()
            if self._batch is None or not len(self._batch):
                return prompted, []
            tic = time.perf_counter()
            generated = self._batch.next()
            self._counters.decode_time += time.perf_counter() - tic
            self._counters.generation_tokens += len(generated)
            self._counters.generation_steps += 1
            return prompted, generated

    @contextmanager
    def stats(self) -> Iterator[BatchStats]:
        """The work the generator does while the block runs, as mlx-lm's
        ``BatchGenerator.stats`` counts it: ``prompt_tokens`` and ``prompt_time`` of the
        prefill, ``generation_tokens``, ``generation_steps`` (rounds and plain steps) and
        ``decode_time`` of the batch, ``wall_time`` and ``peak_memory``.

        Yields:
            BatchStats: mlx-lm's, filled in when the block ends.
        """
        stats = BatchStats()
        start = BatchCountersSnapshot(**asdict(self._counters))
        try:
            yield stats
        finally:
            end = BatchCountersSnapshot(**asdict(self._counters))
            stats += BatchCountersSnapshot.between(start, end)

    def _join(self) -> None:
        """Adds the prefilled sequences to the batch."""
        entries = [row.entry for row, _ in self._ready]
        uids, prompts, most, samplers, keys, lengths, _, stops, _, processors = (
            list(column) for column in zip(*entries, strict=True)
        )
        started = [caches for _, caches in self._ready]
        rows = [row for row, _ in self._ready]
        self._ready = []
        batch = SpeculativeBatch(
            self.model,
            prompts,
            lengths,
            most,
            self.eos_token_ids,
            samplers,
            keys,
            draft_model=self.draft_model,
            drafter=self._drafter,
            prefill_step_size=self.prefill_step_size,
            return_prompt_caches=self.return_prompt_caches,
            policy=self.policy,
            uids=uids,
            prompt_caches=started,
            stop_sequences=stops,
            logits_processors=processors,
        )
        if batch.head is not None:
            # What the head reads of each prompt: the hidden states of the chunks prefilled.
            for s, row in zip(batch.sequences, rows, strict=True):
                s.seen, s.hidden = row.start, row.hidden
        if self._batch is None or not len(self._batch):
            self._batch = batch
        else:
            self._batch.extend(batch)
