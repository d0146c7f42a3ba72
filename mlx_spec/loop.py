"""The speculative loop: rounds of drafter -> target -> rule -> caches, one host read each.

A :class:`Generation` owns one generation: its :class:`Text`, the :class:`Target`, the drafter,
the rule (:mod:`mlx_spec.rules`), the draft-length policy (:mod:`mlx_spec.draft_length`) and the
random state of every text position (:mod:`mlx_spec.keys`). Iterating it runs the generation
and yields each token as soon as its round is read. A round:

1. the policy chooses ``N`` (for a free drafter, from its proposal's kind);
2. the drafter (:mod:`mlx_spec.drafters`) proposes up to ``N`` tokens;
3. the target scores the tokens it still lacks and the ``N`` drafts in one call;
4. the rule decides on the device how many draft tokens to keep and the token after them;
5. one host read brings back that ``[3]`` result together with the draft tokens;
6. every cache is taken back to what was kept (:mod:`mlx_spec.caches`).

``N = 0`` runs plain steps instead, each built and started before the one before is read, as
mlx-lm's plain decoding runs, until the policy chooses to draft again. When the generation ends,
is closed or raises (``KeyboardInterrupt`` included), the caches hold the prompt and the tokens
yielded.
"""

from __future__ import annotations

import math
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from . import _mlx_lm, kernels
from ._checks import FLOAT_DTYPES, ID_DTYPES, MASS_TOLERANCE, describe
from .acceptance import check_next
from .attention import chunking
from .caches import ModelCache, multi_token_calls_exact
from .draft_length import MAX_DRAFT_TOKENS, DraftPolicy, Outcome, Round
from .drafters import Draft, Drafter, DraftSetup
from .keys import KeyChain, set_global_state
from .rules import Rule

__all__ = ["Generation", "SpeculativeStats", "Target", "Text", "vocab_size"]

LogitsProcessor = Callable[[mx.array, mx.array], mx.array]
StreamLike = mx.Stream | mx.ThreadLocalStream | mx.Device


class Text:
    """The text of one generation: the prompt, then the tokens generated so far.

    The loop makes it and hands it to the drafter; ``len(text)`` is its length in tokens.

    Attributes:
        prompt (array): ``[P]`` uint32 prompt tokens.
        generated (list of int): the tokens generated so far.
        history (list of int): the tokens a reused cache held before the prompt (an earlier
            turn of a chat), for drafters that copy from the text; not part of ``len(text)``.
    """

    def __init__(
        self, prompt: mx.array, prompt_ids: list[int], history: list[int] | None = None
    ) -> None:
        self.prompt = prompt
        self.generated: list[int] = []
        self.history = list(history or [])
        self._prompt_ids = prompt_ids
        self._array = prompt

    def __len__(self) -> int:
        return self.prompt.size + len(self.generated)

    @property
    def position(self) -> int:
        """int: the text position of the next token (0 for the first generated one)."""
        return len(self.generated)

    def extend(self, tokens: list[int]) -> None:
        """Appends generated ``tokens``."""
        self.generated.extend(tokens)
        self._array = None

    def tokens(self, start: int, stop: int | None = None) -> mx.array:
        """``[stop - start]`` uint32 tokens of the text (to its end without ``stop``)."""
        stop = len(self) if stop is None else stop
        p = self.prompt.size
        if stop <= p:
            return self.prompt[start:stop]
        tail = mx.array(self.generated[max(start - p, 0) : stop - p], dtype=mx.uint32)
        return mx.concatenate([self.prompt[start:], tail]) if start < p else tail

    def array(self) -> mx.array:
        """``[len(self)]`` uint32: the whole text (built once per round, for logits processors)."""
        if self._array is None:
            self._array = self.tokens(0)
        return self._array

    def ids(self, start: int, stop: int | None = None) -> list[int]:
        """The text's tokens ``start:stop`` as Python ints (no device read)."""
        stop = len(self) if stop is None else stop
        p = len(self._prompt_ids)
        head = self._prompt_ids[start:stop] if start < p else []
        return head + self.generated[max(start - p, 0) : max(stop - p, 0)]


@dataclass
class SpeculativeStats:
    """Counts of one speculative generation, updated as it runs.

    Attributes:
        rounds (int): calls of the target that decided tokens (verifications and plain steps).
        drafted (int): draft tokens verified, over all rounds.
        accepted (int): draft tokens the target accepted, over all rounds.
        generated (int): tokens yielded to the caller.
        replayed (int): tokens fed to the target again because its caches were restored from a
            checkpoint (models with recurrent layers), over all rounds.
        drafted_at (list of int): for each draft position ``i`` (from 0), how many rounds drafted
            a token there.
        accepted_at (list of int): for each draft position ``i``, how many rounds kept it.
    """

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    generated: int = 0
    replayed: int = 0
    drafted_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        """float: ``accepted / drafted`` (0 before any draft)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_round(self) -> float:
        """float: ``generated / rounds``, the mean tokens a target call yields (0 before any)."""
        return self.generated / self.rounds if self.rounds else 0.0

    @property
    def acceptance_at(self) -> list[float]:
        """list of float: for each draft position ``i``, the share of rounds drafting a token
        there that kept it."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at, strict=True)]

    def count(self, drafted: int, accepted: int) -> None:
        """Counts a round that verified ``drafted`` tokens and kept ``accepted``."""
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted
        grow = drafted - len(self.drafted_at)
        if grow > 0:
            self.drafted_at.extend([0] * grow)
            self.accepted_at.extend([0] * grow)
        for i in range(drafted):
            self.drafted_at[i] += 1
            self.accepted_at[i] += i < accepted


def vocab_size(model: nn.Module) -> int | None:
    """The ids ``model`` can embed: its first embedding's rows (``None`` if it has none)."""
    for module in _mlx_lm.modules(model):
        if isinstance(module, nn.QuantizedEmbedding):
            return module.num_embeddings
        if isinstance(module, nn.Embedding):
            return module.weight.shape[0]
    return None


class Target:
    """The target model: its caches, its logits processors, the ids it can embed, and whether a
    verification runs its attention in chunks (:mod:`mlx_spec.attention`: on MLX's CUDA backend)."""

    def __init__(
        self,
        model: nn.Module,
        cache: ModelCache,
        processors: Sequence[LogitsProcessor],
        quantize: Callable[[list[Any]], None],
        quantized_kv_start: int | None,
        vocab: int | None,
        chunked: bool = False,
        split: _mlx_lm.Split | None = None,
    ) -> None:
        self.model = model
        self.cache = cache
        self.processors = list(processors)
        self.quantize = quantize
        self.quantized_kv_start = quantized_kv_start
        self.vocab = vocab
        self.chunked = chunked
        self.exact_calls = multi_token_calls_exact(cache.layers)
        #: The model as backbone and head, where a drafter reads its hidden states.
        self.split = split
        #: ``[k, H]``: the hidden states of the last call's positions (with :attr:`split`).
        self.hidden: mx.array | None = None

    @property
    def processes(self) -> bool:
        """bool: whether logits processors apply (they read the text before each position)."""
        return bool(self.processors)

    @property
    def replays(self) -> bool:
        """bool: whether a rejection restores the caches, whose next call then feeds the kept
        tokens again (recurrent layers whose states are not kept per position)."""
        return self.cache.replays

    def pending(self, text: Text) -> int:
        """The tokens of ``text`` the caches lack, which the next call scores first."""
        return len(text) - self.cache.length

    def feed(self, tokens: mx.array) -> mx.array:
        """Runs the model on ``[k]`` tokens; returns its ``[k, V]`` logits (lazy), and keeps the
        hidden states in :attr:`hidden` where a drafter reads them."""
        with self.cache.feeding(tokens.size):
            if self.split is None:
                logits = self.model(tokens[None], cache=self.cache.layers)
            else:
                states = self.split.backbone(tokens[None], cache=self.cache.layers)
                self.hidden = states[0]
                logits = self.split.head(states)
        return logits[0]

    def prefill(self, text: Text, step: int) -> mx.array | None:
        """Feeds all prompt tokens but the last, ``step`` at a time, quantizing as mlx-lm does.
        Returns their ``[P - 1, H]`` hidden states where a drafter reads them (else, or with
        nothing to feed, ``None``)."""
        states = []
        while self.cache.length < len(text) - 1:
            self.cache.checkpoint()
            self.feed(text.tokens(self.cache.length, min(self.cache.length + step, len(text) - 1)))
            if self.split is not None:
                states.append(self.hidden)
            self.quantize(self.cache.layers)
            mx.eval([c.state for c in self.cache.layers])
            self.cache.forget()
        return mx.concatenate(states) if states else None

    def room(self) -> int:
        """How many tokens a call may feed and give the logits that one-token steps would:
        none but one where a cache keeps its first tokens and this mlx-lm's mask cannot show
        them (:func:`mlx_spec.caches.multi_token_calls_exact`); and while a cache is still in
        full precision, only the tokens up to the length from which mlx-lm quantizes it (its
        one-token steps switch there), one at least."""
        if not self.exact_calls:
            return 1
        if self.quantized_kv_start is None:
            return MAX_DRAFT_TOKENS + 1
        offsets = [c.offset for c in self.cache.layers if type(c) is KVCache]
        if not offsets:
            return MAX_DRAFT_TOKENS + 1
        # A cache at or past the length (a reused one, a short prompt) is quantized after the
        # next call, as mlx-lm quantizes it after its next one-token step.
        return max(self.quantized_kv_start - max(offsets), 1)

    def step(self, tokens: mx.array, context: mx.array | None) -> mx.array:
        """One plain step: runs the model on ``[k]`` tokens and returns the ``[1, V]`` logits of
        the last position (after the processors, ``context`` being the text up to it: ``None``
        without processors); lazy."""
        # A stretch's steps are never undone past the latest checkpoint at the current length
        # (the tokens fed so far are the text's); the older ones would hold every step's
        # recurrent states.
        self.cache.forget(self.cache.length)
        self.cache.checkpoint()
        logits = self.feed(tokens)
        if tokens.size > 1:
            logits = logits[-1:]
        self.quantize(self.cache.layers)
        for processor in self.processors:
            logits = processor(context, logits)
        return logits

    def verify(self, text: Text, draft: mx.array) -> mx.array:
        """Scores the tokens the caches lack and ``[N]`` draft tokens in one call.

        Returns:
            array: the ``[N + 1, V]`` logits (after the processors) of the positions that decide
            the draft, lazy.
        """
        n = draft.size
        self.cache.checkpoint()
        # A draft id the target cannot embed is never accepted; feed a valid id in its place.
        # As uint32, a negative int32 id of a drafter of one's own is one of those too.
        fed = draft if self.vocab is None else mx.minimum(draft.astype(mx.uint32), self.vocab - 1)
        attention = chunking() if self.chunked and n else nullcontext()
        with _mlx_lm.decode_masks(self.cache.layers), self.cache.tracking(), attention:
            logits = self.feed(mx.concatenate([text.tokens(self.cache.length), fed]))[-(n + 1) :]
        if self.split is not None:
            self.hidden = self.hidden[-(n + 1) :]
        if not self.processors:
            return logits
        context = text.array()
        rows = []
        for i in range(n + 1):
            tokens = mx.concatenate([context, draft[:i]]) if i else context
            row = logits[i : i + 1]
            for processor in self.processors:
                row = processor(tokens, row)
            rows.append(row)
        return mx.concatenate(rows)

    def settle(self, text: Text, length: int, feed: bool) -> None:
        """Leaves the caches holding the first ``length`` tokens of ``text``: taken back, and fed
        what they lack when ``feed``; every checkpoint dropped."""
        held = self.cache.rewind(length)
        if feed and held < length:
            self.feed(text.tokens(held, length))
        self.cache.forget()

    def keep(self, length: int, start: int) -> int:
        """Keeps ``length`` tokens of the text, or fewer where a checkpoint had to be restored;
        then quantizes as mlx-lm would. The caches can still be taken back to ``start`` (the
        text before the round, whose tokens may yet be refused when the generation is closed
        mid-round). Returns the tokens the caches hold."""
        held = self.cache.rewind(length)
        self.cache.forget(start)
        self.quantize(self.cache.layers)
        return held


class Generation:
    """One speculative generation; iterate it for ``(token, logprobs, from_draft)``.

    Args:
        text (Text): the prompt (the text grows as the generation runs).
        target (Target): the target model and its caches.
        drafter (Drafter): what proposes draft tokens.
        setup (DraftSetup): what the drafter learns when the generation starts.
        rule (Rule): how tokens are drawn and verified.
        policy (DraftPolicy): how many tokens each round drafts.
        keys (KeyChain, optional): the random state of each text position (``None`` for greedy).
        restore (array, optional): ``mx.random``'s state to leave when the generation ends, for
            a generation given its own key whose sampler sets that state. Default: none (a chain
            started from ``mx.random``'s state leaves the state after the last position drawn,
            as mlx-lm's loop does).
        eos (list of int): end-of-sequence ids: generation ends after the first one emitted.
        stats (SpeculativeStats): filled in as the generation runs.
        stream (Stream or Device): where the models run.
        max_tokens (int): tokens to generate, ``-1`` for no limit.
        prefill_step_size (int): prompt tokens per prefill call.
        progress (callable, optional): called with ``(processed, total)`` prompt tokens before
            and after the prefill.
        group (Group, optional): the distributed group the models run on; its ranks must make
            the same calls, so they choose from rank 0's times and run no stretches.
    """

    def __init__(
        self,
        *,
        text: Text,
        target: Target,
        drafter: Drafter,
        setup: DraftSetup,
        rule: Rule,
        policy: DraftPolicy,
        keys: KeyChain | None,
        restore: mx.array | None,
        eos: list[int],
        stats: SpeculativeStats,
        stream: StreamLike,
        max_tokens: int,
        prefill_step_size: int = 512,
        progress: Callable[[int, int], None] | None = None,
        group: mx.distributed.Group | None = None,
    ) -> None:
        self.text = text
        self.target = target
        self.drafter = drafter
        self.setup = setup
        self.rule = rule
        self.policy = policy
        self.keys = keys
        self.restore = restore
        self.eos = set(eos)
        self.eos_array = mx.array(eos, dtype=mx.uint32) if eos else None
        self.stats = stats
        self.stream = stream
        self.max_tokens = max_tokens
        self.prefill_step_size = prefill_step_size
        self.progress = progress or (lambda *_: None)
        self.group = group
        # The fused kernels where the loop's stream is on a CUDA GPU (the loop never vmaps). The
        # default device would not do: a CPU stream on a CUDA machine cannot run them.
        device = stream if isinstance(stream, mx.Device) else stream.device
        self.fused = kernels.available(device)
        self.on_cpu = device.type == mx.DeviceType.cpu
        self._emitted = 0
        # On a group: the last round's outcome and time, told with this round's read (_round).
        self._unobserved: Outcome | None = None
        self._microseconds = 0

    def __iter__(self) -> Iterator[tuple[int, mx.array, bool]]:
        """Runs the generation: yields each token, the target's ``[V]`` log-probabilities at its
        position (lazy) and whether it came from the draft."""
        if self.max_tokens == 0:
            return
        try:
            with mx.stream(self.stream):
                total = len(self.text)
                self.progress(0, total)
                self.drafter.start(self.text, self.setup)
                hidden = self.target.prefill(self.text, self.prefill_step_size)
                if hidden is not None:
                    self.drafter.see(hidden, 0, self.text)
                self.progress(total, total)
            limit = self.max_tokens if self.max_tokens >= 0 else math.inf
            while self._emitted < limit:
                remaining = min(limit - self._emitted, 2**31)
                with mx.stream(self.stream):
                    n, proposal = self._plan(remaining)
                if n == 0 and self.group is None:
                    steps = self._stretch(remaining, proposal)
                    while (step := self._next(steps)) is not None:
                        self._emitted += 1
                        self.stats.generated += 1
                        yield step[0], step[1], False
                    token = step
                else:
                    with mx.stream(self.stream):
                        tokens, kept, logprobs = self._round(n, proposal, remaining)
                    for i, token in enumerate(tokens):
                        self._emitted += 1
                        self.stats.generated += 1
                        yield token, logprobs[i], i < kept
                if self.text.generated and self.text.generated[-1] in self.eos:
                    return
        finally:
            # Also after an error, an interrupt or a close: the caches then hold the prompt and
            # what was yielded.
            with mx.stream(self.stream):
                try:
                    self._finish(feed=True)
                except Exception:
                    self._finish(feed=False)

    def _next(self, steps: Iterator[tuple[int, mx.array]]) -> tuple[int, mx.array] | None:
        with mx.stream(self.stream):
            return next(steps, None)

    def _plan(self, remaining: int, *, ahead: bool = False) -> tuple[int, Draft | None]:
        """``N`` for the next round (0: plain steps), and a free drafter's proposal, with
        ``remaining`` tokens left to emit. ``ahead``: a plain step is in flight, so the round
        would follow it, after one more token, which would be waiting (asked about the round
        before it, one position cheaper, a policy whose costs put the acceptance between the
        two would end every stretch after two steps, then choose a plain step again)."""
        pending = self.target.pending(self.text) + ahead
        cap = max(min(remaining - ahead - 1, self.target.room() - pending, MAX_DRAFT_TOKENS), 0)
        if cap == 0:
            return 0, None
        proposal = None
        label = 0
        if self.drafter.free:
            # A free proposal first: its kind tells how often such a proposal is kept. N depends
            # on the kind, which the text decides, never on the tokens drawn, so a sampled
            # proposal stays exact (and every rank of a group, holding the same text, chooses
            # alike).
            proposal = self._propose(cap)
            if proposal.size == 0:
                return 0, None
            cap, label = proposal.size, proposal.label
        situation = Round(cap, label, pending, self.target.replays)
        return min(self.policy.choose(situation), cap), proposal

    def _round(
        self, n: int, proposal: Draft | None, remaining: int
    ) -> tuple[list[int], int, mx.array]:
        """One draft-verify round, with one host read: the tokens to emit (at most
        ``remaining``; none after an EOS), how many came from the draft, and the
        ``[N + 1, V]`` log-probabilities (lazy)."""
        start = time.perf_counter()
        length, position = len(self.text), self.text.position
        pending = self.target.pending(self.text)
        draft = proposal.head(n) if proposal is not None else self._propose(n)
        logits = self.target.verify(self.text, draft.tokens)
        keys = self.rule.keys(self.keys, position, draft.size, draft=False) if self.keys else None
        result, logprobs = self.rule.decide(
            logits,
            draft.tokens,
            draft.probs,
            self.eos_array,
            keys,
            fused=self.fused,
            on_cpu=self.on_cpu,
        )
        parts = [result, draft.tokens]
        if draft.probs is not None:
            parts.append(_first_bad_row(draft.probs, draft.tokens))
        if self.group is not None:
            # Every rank chooses from rank 0's time of the round before, read with this one.
            mine = self._microseconds if self.group.rank() == 0 else 0
            parts.append(mx.distributed.all_sum(mx.array([mine], mx.uint32), group=self.group))
        values = mx.concatenate(parts).tolist()  # the round's one host read
        accepted, token = values[0], values[1]
        if draft.probs is not None and values[3 + draft.size]:
            row = values[3 + draft.size] - 1
            raise ValueError(
                f"speculative_generate_step: {type(self.drafter).__name__}.propose returned probs "
                f"whose row {row} is not the distribution its token was drawn from: a negative "
                f"entry, a total off 1 by more than {MASS_TOLERANCE}, or its own token at "
                "probability 0"
            )
        check_next("speculative_generate_step", token)
        tokens = values[3 : 3 + accepted]
        if not (tokens and tokens[-1] in self.eos):
            tokens.append(token)
        tokens = tokens[:remaining]
        kept = min(accepted, len(tokens))
        self.text.extend(tokens)
        self.target.keep(length + kept, length)
        self.drafter.update(self.text, kept)
        if self.target.split is not None:
            # The positions kept: the one before the draft, and each kept draft token.
            self.drafter.see(self.target.hidden[: len(tokens)], length - 1, self.text)
        self.stats.count(draft.size, accepted)
        self.stats.replayed += pending - 1
        outcome = Outcome(draft.size, accepted, draft.label, time.perf_counter() - start, not n)
        if self.group is None:
            self.policy.observe(outcome)
        else:
            # Told a round late, with rank 0's time: every rank's policy learns the same.
            if self._unobserved is not None:
                self.policy.observe(replace(self._unobserved, seconds=values[-1] / 1e6))
            self._unobserved = outcome
            self._microseconds = min(int(outcome.seconds * 1e6), 2**32 - 1)
        return tokens, kept, logprobs

    def _stretch(self, count: int, guess: Draft | None) -> Iterator[tuple[int, mx.array]]:
        """Up to ``count`` plain steps of the target, each built and started before the previous
        one is read, as mlx-lm's plain decoding runs: where drafting does not pay, this costs
        what plain decoding costs, where rounds of one step would each wait for their read.

        Each step draws its token as a round without drafts would (the same keys), so the text
        is the one rounds would give. A free drafter's guess is still checked against each token
        (its acceptance, measured without verifying it): the first token of the proposal that
        chose the step, ``guess`` for the first. After each step the policy is asked again; once
        it chooses to draft, the stretch ends after the step already started.

        Yields:
            tuple[int, array]: each token and its ``[V]`` log-probabilities (lazy); the stretch
            ends early after an EOS.
        """
        pending = self.target.pending(self.text)
        self.stats.replayed += pending - 1
        # The text up to each step, for the processors only (else no graph grows with the steps).
        context = self.text.array() if self.target.processes else None
        missing = self.text.tokens(len(self.text) - pending)
        step = self._plain_step(missing, context, self.text.position)
        clock = time.perf_counter()
        # A drafter that guesses nothing during the stretch sees its hidden states at its end,
        # in one call, as a draft model catches up on the tokens it missed.
        unseen: list[mx.array] = []
        yield from self._steps(step, count, guess, context, clock, unseen)
        if unseen:
            self.drafter.see(mx.concatenate(unseen), len(self.text) - 1 - len(unseen), self.text)

    def _steps(
        self,
        step: tuple[mx.array, mx.array, mx.array, mx.array | None] | None,
        count: int,
        guess: Draft | None,
        context: mx.array | None,
        clock: float,
        unseen: list[mx.array],
    ) -> Iterator[tuple[int, mx.array]]:
        """The steps of :meth:`_stretch` from the one started, ``step``; the hidden states a
        drafter that is not free has yet to see are appended to ``unseen``."""
        last = count
        made = 0
        while step is not None:
            lazy, fed, logprobs, hidden = step
            made += 1
            ahead = None
            if made < last:
                # The next step, built on the lazy token: it computes while this one is read.
                if context is not None:
                    context = mx.concatenate([context, fed])
                ahead = self._plain_step(fed, context, self.text.position + 1)
            # The step's one read, of the token alone: a new op on it (a concatenation, say)
            # would queue behind the step ahead, and the read would wait for both.
            token = lazy.item()
            check_next("speculative_generate_step", token)
            now = time.perf_counter()
            seconds, clock = now - clock, now
            self.text.extend([token])
            # The drafter follows the text (prompt lookup's index), so the next guess is current.
            self.drafter.update(self.text, 0)
            if hidden is not None and self.drafter.free:
                self.drafter.see(hidden, len(self.text) - 2, self.text)
            elif hidden is not None:
                unseen.append(hidden)
            self.stats.count(0, 0)
            tested = guess is not None and guess.size > 0
            # Read as a whole: an op on the guess (its first token) would queue behind the step
            # ahead, and this read would wait for it.
            right = tested and guess.tokens.tolist()[0] == token
            label = guess.label if tested else 0
            self.policy.observe(Outcome(int(tested), int(right), label, seconds, True, made == 1))
            yield token, logprobs[0]
            if token in self.eos:
                return
            guess = None
            if ahead is not None and last == count:
                n, guess = self._plan(count - made, ahead=True)
                if n > 0:
                    # Drafting pays again: the step already started ends the stretch.
                    last = made + 1
            step = ahead

    def _plain_step(
        self, inputs: mx.array, context: mx.array | None, position: int
    ) -> tuple[mx.array, mx.array, mx.array, mx.array | None]:
        """One plain step at text ``position``, started: the lazy ``[1]`` token, the ``[1]`` id
        to feed next, the ``[1, V]`` log-probabilities (see :meth:`Rule.step`) and, where a
        drafter reads them, the ``[1, H]`` hidden state of the position fed last."""
        key = self.rule.keys(self.keys, position, 0, draft=False) if self.keys else None
        logits = self.target.step(inputs, context)
        hidden = self.target.hidden[-1:] if self.target.split is not None else None
        token, fed, logprobs = self.rule.step(logits, key, on_cpu=self.on_cpu)
        mx.async_eval(token)
        return token, fed, logprobs, hidden

    def _propose(self, n: int) -> Draft:
        """The drafter's proposal of at most ``n`` tokens, checked: the rule decides without
        checking its arguments, so a drafter of one's own that returns something else gets a
        ``ValueError`` naming it rather than a wrong round."""
        keys = None
        if self.keys is not None and n and self.drafter.reads_keys:
            keys = self.rule.keys(self.keys, self.text.position, n, draft=True)
        draft = self.drafter.propose(self.text, n, keys)
        problem = _draft_problem(draft, n)
        if problem:
            raise ValueError(
                f"speculative_generate_step: {type(self.drafter).__name__}.propose(text, {n}, "
                f"keys) must return a Draft of at most {n} tokens, got {problem}"
            )
        return draft

    def _finish(self, feed: bool) -> None:
        """Leaves every cache holding the prompt and the tokens yielded, feeding what a cache
        lacks only when ``feed``; leaves ``mx.random``'s state as mlx-lm's loop would. A Ctrl-C
        meanwhile is raised once the caches are whole."""
        length = len(self.text) - self.text.position + self._emitted
        with _interrupts_deferred():
            self.target.settle(self.text, length, feed)
            self.drafter.finish(self.text, length, feed)
        if self.restore is not None:
            set_global_state(self.restore)
        elif self.keys is not None and self.keys.global_state:
            # mlx-lm's loop draws one token ahead of the last one it yields.
            set_global_state(self.keys.state(self._emitted + 1))


@contextmanager
def _interrupts_deferred() -> Iterator[None]:
    """Within it, on the main thread, a SIGINT is held and handled once it ends (Ctrl-C then
    raises ``KeyboardInterrupt`` after the work, not within it); elsewhere it changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[tuple[int, Any]] = []
    previous = signal.signal(signal.SIGINT, lambda number, frame: held.append((number, frame)))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if held and callable(previous):
            previous(*held[0])  # Python's own handler raises KeyboardInterrupt
        elif held and previous == signal.SIG_DFL:
            raise KeyboardInterrupt


def _first_bad_row(probs: mx.array, tokens: mx.array) -> mx.array:
    """``[1]`` uint32: one more than the first row of a drafter's ``[n, V_d]`` ``probs`` that is
    no distribution its token (``[n]``) could be drawn from, else 0; lazy, read with the round."""
    q = probs.astype(mx.float32)
    index = mx.minimum(tokens.astype(mx.uint32), q.shape[-1] - 1)[:, None]
    own = mx.take_along_axis(q, index, -1)
    drawn = mx.logical_and(own[:, 0] > 0, tokens.astype(mx.uint32) < q.shape[-1])
    total = mx.abs(mx.sum(q, axis=-1) - 1) <= MASS_TOLERANCE
    ok = mx.logical_and(mx.logical_and(drawn, total), mx.min(q, axis=-1) >= 0)
    first = mx.argmin(ok.astype(mx.uint32)).astype(mx.uint32)
    return mx.where(mx.all(ok), 0, first + 1).astype(mx.uint32)[None]


def _draft_problem(draft: object, n: int) -> str | None:
    """What is wrong with a proposal of at most ``n`` tokens (``None``: nothing)."""
    if not isinstance(draft, Draft):
        return f"a {type(draft).__name__}"
    tokens, probs = draft.tokens, draft.probs
    if not isinstance(tokens, mx.array) or tokens.ndim != 1 or tokens.dtype not in ID_DTYPES:
        what = describe(tokens) if isinstance(tokens, mx.array) else type(tokens).__name__
        return f"tokens of {what} (need [n] uint32 or int32)"
    if tokens.size > n:
        return f"{tokens.size} tokens"
    if probs is not None and (
        not isinstance(probs, mx.array)
        or probs.ndim != 2
        or probs.shape[0] != tokens.size
        or (tokens.size and probs.shape[1] == 0)
        or probs.dtype not in FLOAT_DTYPES
    ):
        what = describe(probs) if isinstance(probs, mx.array) else type(probs).__name__
        return f"probs of {what} for {tokens.size} tokens (need [n, V_d] float, V_d >= 1)"
    if isinstance(draft.label, bool) or not isinstance(draft.label, int):
        return f"a label of {type(draft.label).__name__} (need an int)"
    return None
