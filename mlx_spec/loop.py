"""The speculative loop: rounds of drafter -> target -> rule -> caches, one host read each.

:func:`run` drives a :class:`Generation` (its text, :class:`Target`, drafter, rule and draft
lengths) round by round and yields each token as soon as its round is read. A round:

1. the drafter (:mod:`mlx_spec.drafters`) proposes up to ``N`` tokens, with the distributions
   they were drawn from when the generation samples;
2. the target scores the tokens it still lacks and the ``N`` drafts in one call;
3. the rule (:mod:`mlx_spec.rules`) decides on the device how many draft tokens to keep and the
   token after them;
4. one host read brings back that ``[3]`` result together with the draft tokens;
5. every cache is taken back to what was kept (:mod:`mlx_spec.caches`): trimmed where that is
   exact, set to the state kept after the last kept position for the recurrent layers that
   :mod:`mlx_spec.recurrent` knows, else restored from a checkpoint, the kept tokens then going
   into the next round's call.

When the generation ends, is closed or raises, the caches hold the prompt and the tokens yielded.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Generator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from . import kernels
from ._checks import FLOAT_DTYPES, ID_DTYPES, describe
from .acceptance import check_next
from .attention import chunking
from .caches import ModelCache, decode_masks
from .draft_length import MAX_DRAFT_TOKENS, CostKey, DraftLength, keep
from .drafters import Draft, Drafter, DraftSetup, Text
from .rules import Rule

__all__ = ["Generation", "SpeculativeStats", "Target", "run", "vocab_size"]

LogitsProcessor = Callable[[mx.array, mx.array], mx.array]
StreamLike = mx.Stream | mx.ThreadLocalStream | mx.Device

#: Plain steps a stretch runs before the draft length is chosen again (when drafting does not pay).
#: Consecutive stretches double up to LONGEST_STRETCH, a round starting them short again: each
#: stretch starts its pipeline anew, its first step waiting for its own host work, while a free
#: drafter's guesses are checked at every step of a stretch, which ends at once where one pays.
STRETCH = 8
LONGEST_STRETCH = 64

_NONE = Draft(mx.array([], dtype=mx.uint32))


@dataclass
class SpeculativeStats:
    """Counts of one speculative generation, updated as it runs.

    Attributes:
        rounds (int): verification calls of the target.
        drafted (int): draft tokens verified, over all rounds.
        accepted (int): draft tokens the target accepted, over all rounds.
        generated (int): tokens yielded to the caller.
        replayed (int): tokens fed to the target again because its caches were restored from a
            checkpoint (models with recurrent layers), over all rounds.
    """

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    generated: int = 0
    replayed: int = 0

    @property
    def acceptance_rate(self) -> float:
        """float: ``accepted / drafted`` (0 before any draft)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_round(self) -> float:
        """float: ``generated / rounds``, the mean tokens a target call yields (0 before any)."""
        return self.generated / self.rounds if self.rounds else 0.0


def vocab_size(model: nn.Module) -> int | None:
    """The ids ``model`` can embed: its first embedding's rows (``None`` if it has none)."""
    for _, module in model.named_modules():
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
    ) -> None:
        self.model = model
        self.cache = cache
        self.processors = list(processors)
        self.quantize = quantize
        self.quantized_kv_start = quantized_kv_start
        self.vocab = vocab
        self.chunked = chunked

    def feed(self, tokens: mx.array) -> mx.array:
        """Runs the model on ``[k]`` tokens; returns its ``[k, V]`` logits (lazy)."""
        logits = self.model(tokens[None], cache=self.cache.layers)
        self.cache.fed(tokens.size)
        return logits[0]

    def prefill(self, text: Text, step: int) -> None:
        """Feeds all prompt tokens but the last, ``step`` at a time, quantizing as mlx-lm does."""
        while self.cache.length < len(text) - 1:
            self.feed(text.tokens(self.cache.length, min(self.cache.length + step, len(text) - 1)))
            self.quantize(self.cache.layers)
            mx.eval([c.state for c in self.cache.layers])

    def room(self) -> int:
        """How many tokens a call may feed before a cache still in full precision passes the
        length from which mlx-lm quantizes it: mlx-lm's one-token steps switch there, so a
        verification must not straddle it to give the same logits."""
        if self.quantized_kv_start is None:
            return MAX_DRAFT_TOKENS + 1
        offsets = [c.offset for c in self.cache.layers if type(c) is KVCache]
        if not offsets or max(offsets) >= self.quantized_kv_start:
            return MAX_DRAFT_TOKENS + 1
        return self.quantized_kv_start - max(offsets)

    def step(self, tokens: mx.array, context: mx.array | None) -> mx.array:
        """One plain step: runs the model on ``[k]`` tokens and returns the ``[1, V]`` logits of
        the last position (after the processors, ``context`` being the text up to it: ``None``
        without processors); lazy."""
        self.cache.checkpoint()
        logits = self.feed(tokens)[-1:]
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
        attention = chunking() if self.chunked else nullcontext()
        with decode_masks(self.cache.layers), self.cache.tracking(), attention:
            logits = self.feed(mx.concatenate([text.tokens(self.cache.length), fed]))[-(n + 1) :]
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
    """One speculative generation: the text, the target, the drafter and the rule."""

    def __init__(
        self,
        text: Text,
        target: Target,
        drafter: Drafter,
        rule: Rule,
        lengths: DraftLength,
        eos: list[int],
        key: mx.array | None,
        stats: SpeculativeStats,
        stream: StreamLike,
        group: mx.distributed.Group | None = None,
        costs: CostKey | None = None,
    ) -> None:
        self.text = text
        self.target = target
        self.drafter = drafter
        self.rule = rule
        self.lengths = lengths
        self.eos_set = set(eos)
        self.eos_array = mx.array(eos, dtype=mx.uint32) if eos else None
        # The fused kernels where the loop's stream is on a CUDA GPU (the loop never vmaps). The
        # default device would not do: a CPU stream on a CUDA machine cannot run them.
        device = stream if isinstance(stream, mx.Device) else stream.device
        self.fused = kernels.available(device)
        self.on_cpu = device.type == mx.DeviceType.cpu
        self.key = key
        self.stats = stats
        # On a group, adaptive lengths are chosen from rank 0's times, which every rank reads a
        # round late: each rank then makes the same target calls.
        self.group = group if lengths.adaptive else None
        #: Where what the draft lengths measured is kept for the next generation (see
        #: :func:`mlx_spec.draft_length.cost_key`); ``None`` to keep nothing.
        self.costs = costs
        # The last round's counts and label, recorded with its time a round later.
        self._unrecorded: tuple[tuple[int, int, int, int], int] | None = None
        #: The plain steps of the next stretch (see :meth:`stretch`).
        self.next_stretch = STRETCH
        self._microseconds = 0
        # A free drafter's proposal made by plan for the next round (see plan).
        self._proposal: Draft | None = None

    def plan(self, remaining: int) -> int:
        """The number of draft tokens of the next round (0 with adaptive lengths: a stretch of
        plain steps, see :meth:`stretch`).

        Args:
            remaining (int): the most tokens the next round may emit, ``>= 1``.
        """
        pending = len(self.text) - self.target.cache.length
        cap = max(min(remaining - 1, self.target.room() - pending), 0)
        replays = self.target.cache.replays
        self._proposal = None
        if self.lengths.adaptive and self.drafter.free:
            # A free proposal first: with nothing to propose the next tokens are plain steps, and
            # its label tells how often such a proposal is kept. N depends on the label, which
            # the text decides, never on the tokens drawn, so a sampled proposal stays exact
            # (and every rank of a group, holding the same text, chooses alike).
            proposal = self._propose(min(self.lengths.most, cap), None)
            if proposal.size == 0:
                self.lengths.measuring = False
                self.lengths.no_proposal()
                return 0
            self._proposal = proposal
            return self.lengths.choose(pending, cap, replays, proposal.label)
        return self.lengths.choose(pending, cap, replays)

    @property
    def stretches(self) -> bool:
        """Whether rounds that draft nothing run as stretches of pipelined plain steps: with
        adaptive lengths, but not on a group (whose ranks must time their rounds alike)."""
        return self.lengths.adaptive and self.lengths.stretches

    def round(self, n: int, remaining: int) -> tuple[list[int], int, mx.array]:
        """One draft-verify round, with one host read.

        Args:
            n (int): the most draft tokens (from :meth:`plan`).
            remaining (int): the most tokens this round may emit, ``>= 1``.

        Returns:
            tuple: the tokens to emit (at most ``remaining``; none after an EOS), how many of
            them came from the draft, and the ``[N + 1, V]`` log-probabilities (lazy).
        """
        start = time.perf_counter()
        self.next_stretch = STRETCH
        length = len(self.text)
        pending = length - self.target.cache.length
        draft_key = verify_key = None
        if self.rule.random:
            self.key, draft_key, verify_key = mx.random.split(self.key, 3)
        if self._proposal is not None:
            draft = self._proposal.head(n)
        else:
            draft = self._propose(n, draft_key)
        # Nothing to verify: a free drafter is still asked, to measure its acceptance.
        shadow = (
            self._propose(1, None)
            if draft.size == 0 and self.lengths.adaptive and self.drafter.free
            else None
        )
        logits = self.target.verify(self.text, draft.tokens)
        result, logprobs = self.rule.decide(
            logits,
            draft.tokens,
            draft.probs,
            self.eos_array,
            verify_key,
            fused=self.fused,
            on_cpu=self.on_cpu,
        )
        parts = [result, draft.tokens] + ([shadow.tokens] if shadow is not None else [])
        if self.group is not None:
            mine = self._microseconds if self.group.rank() == 0 else 0
            parts.append(mx.distributed.all_sum(mx.array([mine], mx.uint32), group=self.group))
        values = mx.concatenate(parts).tolist()  # the round's one host read
        accepted, token = values[0], values[1]
        check_next("speculative_generate_step", token)
        tokens = values[3 : 3 + accepted]
        if not (tokens and tokens[-1] in self.eos_set):
            tokens.append(token)
        tokens = tokens[:remaining]
        kept = min(accepted, len(tokens))
        self.text.extend(tokens)
        self.target.keep(length + kept, length)
        self.drafter.update(self.text, kept)
        if shadow is not None and shadow.size:
            self.lengths.shadow(int(values[3 + draft.size] == token), 1, shadow.label)
        self.stats.rounds += 1
        self.stats.drafted += draft.size
        self.stats.accepted += accepted
        self.stats.replayed += pending - 1
        counts = (draft.size, accepted, pending + draft.size, draft.steps)
        seconds = time.perf_counter() - start
        if self.group is None:
            self.lengths.record(*counts, seconds, draft.label)
        else:
            if self._unrecorded is not None:
                previous, label = self._unrecorded
                self.lengths.record(*previous, values[-1] / 1e6, label)
            self._unrecorded = counts, draft.label
            self._microseconds = min(int(seconds * 1e6), 2**32 - 1)
        return tokens, kept, logprobs

    def stretch(self, count: int) -> Generator[tuple[int, mx.array], None, None]:
        """Up to ``count`` plain steps of the target, each built and started before the previous
        one is read, as mlx-lm's plain decoding runs: where drafting does not pay, this costs
        what plain decoding costs, where rounds of one step would each wait for their read.

        Each step draws its token as a round without drafts would (the same keys), so the text
        is the one rounds would give. A free drafter's proposals are still checked against the
        tokens (its acceptance, measured without verifying it). The next stretch is twice as long
        (see :data:`LONGEST_STRETCH`) unless a round comes first. A right guess of a kind worth
        verifying (:meth:`DraftLength.pays`) ends the stretch after the step already started,
        unless the stretch measures what plain steps cost.

        Yields:
            tuple[int, array]: each token and its ``[V]`` log-probabilities (lazy); the stretch
            ends early after an EOS.
        """
        start = time.perf_counter()
        held = self.target.cache.length
        self.stats.replayed += len(self.text) - held - 1
        # The text up to each step, for the processors only (else no graph grows with the steps).
        context = self.text.array() if self.target.processors else None
        made = 0
        # The steps this stretch runs: fewer once a copy begins (below).
        last = count
        replays = self.target.cache.replays
        step = self._plain_step(self.text.tokens(held), context)
        # When the first step was read: it waited for its own host work, which each later step
        # hides behind the step ahead (a restart, see DraftLength.record_restart).
        first = start
        while step is not None:
            lazy, fed, logprobs = step
            made += 1
            ahead = None
            if made < last:
                # The next step, built on the lazy token: it computes while this one is read.
                if context is not None:
                    context = mx.concatenate([context, fed])
                ahead = self._plain_step(fed, context)
            guess = self._propose(1, None) if self.drafter.free else _NONE
            # The step's one read, of the token alone: a new op on it (a concatenation, say)
            # would queue behind the step ahead, and the read would wait for both.
            token = lazy.item()
            if made == 1:
                first = time.perf_counter()
            check_next("speculative_generate_step", token)
            self.text.extend([token])
            # The drafter follows the text (prompt lookup's index), so the next guess is current.
            self.drafter.update(self.text, 0)
            if guess.size:
                right = guess.tokens.tolist()[0] == token
                self.lengths.shadow(int(right), 1, guess.label)
                if right and made + 1 < last and not self.lengths.measuring:
                    if self.lengths.pays(guess.label, replays):
                        # A copy begins: the step already started ends the stretch, and a round
                        # drafts on from there.
                        last = made + 1
            self.stats.rounds += 1
            yield token, logprobs[0]
            if token in self.eos_set:
                break
            step = ahead
        self.lengths.ran_plain(made)
        self.lengths.record_restart(first - start)
        if last == count:
            # A stretch cut short is mostly its first steps, unpipelined: not what plain steps
            # cost once they run.
            self.lengths.record_plain((time.perf_counter() - start) / made)
        self.next_stretch = min(2 * self.next_stretch, LONGEST_STRETCH)

    def _plain_step(
        self, inputs: mx.array, context: mx.array | None
    ) -> tuple[mx.array, mx.array, mx.array]:
        """One plain step, started: the lazy ``[1]`` token, the ``[1]`` id to feed next and the
        ``[1, V]`` log-probabilities (see :meth:`Rule.step`)."""
        key = None
        if self.rule.random:
            self.key, _, key = mx.random.split(self.key, 3)
        logits = self.target.step(inputs, context)
        token, fed, logprobs = self.rule.step(logits, key, fused=self.fused, on_cpu=self.on_cpu)
        mx.async_eval(token)
        return token, fed, logprobs

    def _propose(self, n: int, key: mx.array | None) -> Draft:
        """The drafter's proposal of at most ``n`` tokens, checked: the rule decides without
        checking its arguments, so a drafter of one's own that returns something else gets a
        ``ValueError`` naming it rather than a wrong round."""
        draft = self.drafter.propose(self.text, n, key)
        problem = _draft_problem(draft, n)
        if problem:
            raise ValueError(
                f"speculative_generate_step: {type(self.drafter).__name__}.propose(text, {n}, "
                f"key) must return a Draft of at most {n} tokens, got {problem}"
            )
        return draft

    def finish(self, consumed: int, feed: bool) -> None:
        """Leaves every cache holding the prompt and the ``consumed`` tokens, feeding what a
        cache lacks only when ``feed``; keeps the costs measured for the next generation."""
        length = self.text.prompt.size + consumed
        held = self.target.cache.rewind(length)
        if feed and held < length:
            self.target.feed(self.text.tokens(held, length))
        self.target.cache.forget()
        self.drafter.finish(self.text, length, feed)
        if self.costs is not None:
            keep(self.costs, self.lengths.measured())


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
        or probs.dtype not in FLOAT_DTYPES
    ):
        what = describe(probs) if isinstance(probs, mx.array) else type(probs).__name__
        return f"probs of {what} for {tokens.size} tokens (need [n, V_d] float)"
    return None


def run(
    generation: Generation,
    setup: DraftSetup,
    stream: StreamLike,
    max_tokens: int,
    prefill_step_size: int,
    progress: Callable[[int, int], None],
) -> Generator[tuple[int, mx.array, bool], None, None]:
    if max_tokens == 0:
        return
    consumed = 0
    total = generation.text.prompt.size
    try:
        with mx.stream(stream):
            progress(0, total)
            generation.drafter.start(generation.text, setup)
            generation.target.prefill(generation.text, prefill_step_size)
            progress(total, total)
        limit = max_tokens if max_tokens >= 0 else math.inf
        while True:
            remaining = min(limit - consumed, 2**31)
            with mx.stream(stream):
                n = generation.plan(remaining)
            if n == 0 and generation.stretches:
                steps = generation.stretch(min(generation.next_stretch, remaining))
                tokens: list[int] = []
                while True:
                    with mx.stream(stream):
                        step = next(steps, None)
                    if step is None:
                        break
                    tokens.append(step[0])
                    consumed += 1
                    generation.stats.generated += 1
                    yield step[0], step[1], False
            else:
                with mx.stream(stream):
                    tokens, from_draft, logprobs = generation.round(n, remaining)
                for i, token in enumerate(tokens):
                    consumed += 1
                    generation.stats.generated += 1
                    yield token, logprobs[i], i < from_draft
            if consumed == max_tokens or (tokens and tokens[-1] in generation.eos_set):
                return
    finally:
        # Also after an error or a close: the caches then hold the prompt and what was yielded.
        with mx.stream(stream):
            try:
                generation.finish(consumed, feed=True)
            except Exception:
                generation.finish(consumed, feed=False)
